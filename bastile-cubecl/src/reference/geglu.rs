//! f64 reference of GPT-OSS's clamped GEGLU (see [`crate::geglu`]).

/// Forward over interleaved `(gate, up)` pairs: one output per pair.
pub fn forward(input: &[f64], alpha: f64, limit: f64, round: impl Fn(f64) -> f64) -> Vec<f64> {
    input
        .chunks_exact(2)
        .map(|p| {
            let g = p[0].min(limit);
            let u = p[1].clamp(-limit, limit);
            let s = round(1.0 / (1.0 + (-round(alpha * g)).exp()));
            round(u + 1.0) * round(g * s)
        })
        .collect()
}

/// Backward: the interleaved input gradient.
pub fn backward(
    input: &[f64],
    dout: &[f64],
    alpha: f64,
    limit: f64,
    round: impl Fn(f64) -> f64,
) -> Vec<f64> {
    let mut out = Vec::with_capacity(input.len());
    for (p, &d) in input.chunks_exact(2).zip(dout) {
        let (g0, u0) = (p[0], p[1]);
        let g = g0.min(limit);
        let u = u0.clamp(-limit, limit);
        let s = round(1.0 / (1.0 + (-round(alpha * g)).exp()));
        let glu = round(g * s);
        let u1 = round(u + 1.0);
        let du1 = round(d * glu);
        let dglu = round(d * u1);
        let dz = round(round(dglu * g) * s * (1.0 - s));
        let dg = round(round(dglu * s) + round(dz * alpha));
        out.push(if g0 <= limit { dg } else { 0.0 });
        out.push(if (-limit..=limit).contains(&u0) {
            du1
        } else {
            0.0
        });
    }
    out
}
