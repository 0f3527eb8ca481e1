//! f64 reference of a LoRA adapter on a linear layer (see
//! `bastile::lora_linear`): `y = x·W + bias + s·(x·A)·B`, and the gradients
//! of `Σ y·g` for `x`, `A` and `B` ([`forward_backward`]) and for a trained
//! `W` and bias ([`base_grads`]). Matrices are row-major: `x` `[n, i]`,
//! `w` `[i, o]`, `a` `[i, r]`, `b` `[r, o]`, `g` `[n, o]`; an empty `w` or
//! `bias` leaves that term out (the update alone).

/// The sizes `[n, i, r, o]` and the tensors of one problem.
pub struct Problem<'a> {
    pub sizes: [usize; 4],
    pub x: &'a [f64],
    pub w: &'a [f64],
    pub bias: &'a [f64],
    pub a: &'a [f64],
    pub b: &'a [f64],
    pub scale: f64,
}

/// `[y, dx, dA, dB]` for output gradient `g`.
pub fn forward_backward(p: &Problem, g: &[f64]) -> [Vec<f64>; 4] {
    let [n, i, r, o] = p.sizes;
    let (x, w, a, b, s) = (p.x, p.w, p.a, p.b, p.scale);
    let dot = |len: usize, f: &dyn Fn(usize) -> f64| (0..len).map(f).sum::<f64>();
    let xa: Vec<f64> = (0..n * r)
        .map(|e| dot(i, &|c| x[e / r * i + c] * a[c * r + e % r]))
        .collect();
    let y: Vec<f64> = (0..n * o)
        .map(|e| {
            let (t, j) = (e / o, e % o);
            let base = if w.is_empty() {
                0.0
            } else {
                dot(i, &|c| x[t * i + c] * w[c * o + j])
            };
            let bias = if p.bias.is_empty() { 0.0 } else { p.bias[j] };
            base + bias + s * dot(r, &|k| xa[t * r + k] * b[k * o + j])
        })
        .collect();
    // The gradient of x·A: s · g · Bᵀ.
    let gb: Vec<f64> = (0..n * r)
        .map(|e| s * dot(o, &|j| g[e / r * o + j] * b[e % r * o + j]))
        .collect();
    let dx = (0..n * i)
        .map(|e| {
            let (t, c) = (e / i, e % i);
            let base = if w.is_empty() {
                0.0
            } else {
                dot(o, &|j| g[t * o + j] * w[c * o + j])
            };
            base + dot(r, &|k| gb[t * r + k] * a[c * r + k])
        })
        .collect();
    let da = (0..i * r)
        .map(|e| dot(n, &|t| x[t * i + e / r] * gb[t * r + e % r]))
        .collect();
    let db = (0..r * o)
        .map(|e| s * dot(n, &|t| xa[t * r + e / o] * g[t * o + e % o]))
        .collect();
    [y, dx, da, db]
}

/// `[dW, dbias]` for output gradient `g`: `xᵀ · g` and `g`'s column sums.
pub fn base_grads(p: &Problem, g: &[f64]) -> [Vec<f64>; 2] {
    let [n, i, _, o] = p.sizes;
    let dw = (0..i * o)
        .map(|e| (0..n).map(|t| p.x[t * i + e / o] * g[t * o + e % o]).sum())
        .collect();
    let dbias = (0..o).map(|j| (0..n).map(|t| g[t * o + j]).sum()).collect();
    [dw, dbias]
}
