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
