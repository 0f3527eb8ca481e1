//! f64 reference AdamW and gradient clipping (see [`crate::adamw`] for the
//! semantics).

use crate::adamw::AdamWStep;

/// The global L2 norm of every gradient.
pub fn global_norm(grads: &[&[f64]]) -> f64 {
    grads
        .iter()
        .flat_map(|g| g.iter())
        .map(|x| x * x)
        .sum::<f64>()
        .sqrt()
}

/// `clip_grad_norm_`'s factor: `min(1, max_norm / (norm + 1e-6))`, or 1
/// without clipping.
pub fn clip_scale(norm: f64, max_norm: Option<f64>) -> f64 {
    max_norm.map_or(1.0, |max| (max / (norm + 1e-6)).min(1.0))
}

/// The state of one parameter: its weights (the master copy when there is
/// one) and both moments.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamState {
    pub weights: Vec<f64>,
    pub moment1: Vec<f64>,
    pub moment2: Vec<f64>,
}

impl ParamState {
    /// Weights `weights` with zero moments, as before the first step.
    pub fn new(weights: Vec<f64>) -> Self {
        let n = weights.len();
        Self {
            weights,
            moment1: vec![0.0; n],
            moment2: vec![0.0; n],
        }
    }

    /// One step with the gradient `grad` scaled by `scale`. `round_weights`
    /// and `round_moments` give the values the stored dtypes hold after it.
    pub fn step(
        &mut self,
        grad: &[f64],
        scale: f64,
        hyper: &AdamWStep,
        round_weights: impl Fn(f64) -> f64,
        round_moments: impl Fn(f64) -> f64,
    ) {
        let (bias1, bias2) = hyper.bias_corrections();
        let decay = 1.0 - hyper.learning_rate * hyper.weight_decay;
        for (i, g) in grad.iter().enumerate() {
            let g = g * scale;
            let m = hyper.beta1 * self.moment1[i] + (1.0 - hyper.beta1) * g;
            let v = hyper.beta2 * self.moment2[i] + (1.0 - hyper.beta2) * g * g;
            let update = (m / bias1) / ((v / bias2).sqrt() + hyper.epsilon);
            let p = self.weights[i] * decay - hyper.learning_rate * update;
            self.moment1[i] = round_moments(m);
            self.moment2[i] = round_moments(v);
            self.weights[i] = round_weights(p);
        }
    }
}
