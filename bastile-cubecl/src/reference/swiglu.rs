//! f64 reference SwiGLU (see [`crate::swiglu`] for the semantics).

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// Forward: `cast(cast(silu(g)) · u)` element by element.
pub fn forward(gate: &[f64], up: &[f64], round: impl Fn(f64) -> f64) -> Vec<f64> {
    gate.iter()
        .zip(up)
        .map(|(&g, &u)| round(g * sigmoid(g)) * u)
        .collect()
}

/// Backward: `(d_gate, d_up)`.
pub fn backward(
    gate: &[f64],
    up: &[f64],
    dout: &[f64],
    round: impl Fn(f64) -> f64,
) -> (Vec<f64>, Vec<f64>) {
    let mut dg = Vec::with_capacity(gate.len());
    let mut du = Vec::with_capacity(gate.len());
    for ((&g, &u), &d) in gate.iter().zip(up).zip(dout) {
        let s = sigmoid(g);
        dg.push(round(d * u) * s * (1.0 + g * (1.0 - s)));
        du.push(d * round(g * s));
    }
    (dg, du)
}

/// The size `d_gate`'s error is measured against, per element: its value
/// plus its terms', `|dout · up| · σ(g) · (1 + |g| · (1 − σ(g)))`.
/// `d_gate` is `dout · up · σ(g) · (1 + g · (1 − σ(g)))`, whose last factor
/// cancels to zero at g ≈ −1.28; near there the value is far smaller than
/// its terms, and their f32 rounding is a large part of it (a one-element
/// tensor drawn there measured 1.07e-5 relative, over f32's bound).
pub fn d_gate_size(gate: &[f64], up: &[f64], dout: &[f64], d_gate: &[f64]) -> Vec<f64> {
    gate.iter()
        .zip(up)
        .zip(dout)
        .zip(d_gate)
        .map(|(((&g, &u), &d), &value)| {
            let s = sigmoid(g);
            value.abs() + (d * u).abs() * s * (1.0 + g.abs() * (1.0 - s))
        })
        .collect()
}
