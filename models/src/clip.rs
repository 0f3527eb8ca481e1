//! Gradient clipping by the global norm, as HF's `clip_grad_norm_`: one L2
//! norm over every gradient of the step, and every gradient scaled by
//! `min(1, max_norm / (norm + 1e-6))`. Burn's `GradientClippingConfig::Norm`
//! clips each parameter by its own norm instead, which changes the
//! direction of the update, not only its length.

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor};

/// The sum of squares of every gradient, in f32.
struct SumSquares<'a, B: AutodiffBackend> {
    grads: &'a GradientsParams,
    total: Option<Tensor<B::InnerBackend, 1>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for SumSquares<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) {
            let s = g.cast(DType::F32).square().sum();
            self.total = Some(match self.total.take() {
                Some(t) => t + s,
                None => s,
            });
        }
    }
}

/// Multiplies every gradient by one device scalar.
struct Scale<'a, B: AutodiffBackend> {
    grads: &'a mut GradientsParams,
    coef: Tensor<B::InnerBackend, 1>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Scale<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            let coef = self.coef.clone().cast(g.dtype()).unsqueeze::<D>();
            self.grads.register(param.id, g * coef);
        }
    }
}

/// Scales the gradients of `module` so that their global L2 norm is at
/// most `max_norm`. The norm stays on the device: no host read.
pub fn clip_grad_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    mut grads: GradientsParams,
    max_norm: f32,
) -> GradientsParams {
    let mut sum = SumSquares::<B> {
        grads: &grads,
        total: None,
    };
    module.visit(&mut sum);
    let Some(total) = sum.total else {
        return grads;
    };
    let coef = total
        .sqrt()
        .add_scalar(1e-6)
        .recip()
        .mul_scalar(max_norm)
        .clamp_max(1.0);
    module.visit(&mut Scale::<B> {
        grads: &mut grads,
        coef,
    });
    grads
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, NdArray};
    use burn::nn::LinearConfig;
    use burn::tensor::{Distribution, Tensor};

    use super::*;

    type B = Autodiff<NdArray>;

    fn values<const D: usize>(t: Tensor<NdArray, D>) -> Vec<f64> {
        t.into_data().convert::<f64>().to_vec::<f64>().unwrap()
    }

    /// One global coefficient for every parameter (not one per parameter),
    /// and nothing changes below the threshold.
    #[test]
    fn scales_every_gradient_by_the_global_norm() {
        let device = Default::default();
        let linear = LinearConfig::new(5, 3).init::<B>(&device);
        let x = Tensor::<B, 2>::random([4, 5], Distribution::Normal(0.0, 1.0), &device);
        let w = Tensor::<B, 2>::random([4, 3], Distribution::Normal(0.0, 3.0), &device);
        let grads_of = || {
            let loss = (linear.forward(x.clone()) * w.clone()).sum();
            GradientsParams::from_grads(loss.backward(), &linear)
        };
        let bias = linear.bias.as_ref().expect("bias").id;
        let read = |g: &GradientsParams| {
            (
                values(g.get::<NdArray, 2>(linear.weight.id).unwrap()),
                values(g.get::<NdArray, 1>(bias).unwrap()),
            )
        };
        let (gw, gb) = read(&grads_of());
        let norm = gw.iter().chain(&gb).map(|v| v * v).sum::<f64>().sqrt();
        // The two parameters' own norms differ, so per-parameter clipping
        // would scale them differently.
        let own = |g: &[f64]| g.iter().map(|v| v * v).sum::<f64>().sqrt();
        assert!((own(&gw) - own(&gb)).abs() > 1e-3 * norm);

        let max = (norm / 4.0) as f32;
        let (cw, cb) = read(&clip_grad_norm(&linear, grads_of(), max));
        let coef = max as f64 / (norm + 1e-6);
        for (c, g) in cw.iter().zip(&gw).chain(cb.iter().zip(&gb)) {
            assert!((c - g * coef).abs() <= 1e-5 * norm, "{c} vs {}", g * coef);
        }
        let clipped = cw.iter().chain(&cb).map(|v| v * v).sum::<f64>().sqrt();
        assert!(
            (clipped - max as f64).abs() < 1e-4 * max as f64,
            "{clipped} vs {max}"
        );

        // Below the threshold the coefficient is exactly 1 (the gradients
        // are recomputed, so allow NdArray's summation-order noise).
        let (uw, ub) = read(&clip_grad_norm(&linear, grads_of(), (norm * 2.0) as f32));
        for (u, g) in uw.iter().zip(&gw).chain(ub.iter().zip(&gb)) {
            assert!(
                (u - g).abs() <= 1e-6 * norm,
                "{u} vs {g}: changed below the threshold"
            );
        }
    }
}
