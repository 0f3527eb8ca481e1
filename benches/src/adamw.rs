//! The optimizer step: Bastile's fused AdamW against Burn's AdamW after
//! the global-norm clip HF Trainer applies, over the parameters of a
//! Qwen3-0.6B-sized model (or a small set with `--tiny`).
//!
//! Bytes counted: what the step must move, the parameter and both moments
//! read and written and the gradient read once: `7 ×` the dtype's bytes per
//! element, moments in the parameters' dtype. The norm's second read of the
//! gradients is not counted.

use bastile::BastileBackend;
use bastile::optim::AdamWConfig;
use bastile_models::clip::clip_grad_norm;
use burn::backend::Autodiff;
use burn::module::{Module, Param};
use burn::optim::{AdamWConfig as BurnAdamWConfig, GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Distribution, Tensor};

use crate::Args;
use crate::report::Report;
use crate::timing::median_seconds;

#[derive(Module, Debug)]
struct Weights<B: Backend> {
    w: Vec<Param<Tensor<B, 2>>>,
}

/// The weight shapes of `layers` Qwen3-0.6B decoder layers and its
/// embedding.
fn shapes(tiny: bool) -> Vec<[usize; 2]> {
    let (hidden, inter, layers, vocab) = if tiny {
        (256, 768, 2, 4096)
    } else {
        (1024, 3072, 28, 151936)
    };
    let mut out = vec![[vocab, hidden]];
    for _ in 0..layers {
        out.extend([
            [2 * hidden, hidden],
            [hidden, hidden],
            [hidden, hidden],
            [hidden, 2 * hidden],
            [inter, hidden],
            [inter, hidden],
            [hidden, inter],
            [1, hidden],
            [1, hidden],
        ]);
    }
    out
}

pub fn bench<B>(device: &B::Device, args: &Args, report: &mut Report)
where
    B: bastile::ops::KernelBackend + BastileBackend,
{
    type Inner<B> = bastile::Bastile<B>;
    type A<B> = Autodiff<Inner<B>>;
    let dtype = if args.tiny { DType::F32 } else { DType::BF16 };
    let shapes = shapes(args.tiny);
    let numel: usize = shapes.iter().map(|s| s[0] * s[1]).sum();
    let weights = Weights::<A<B>> {
        w: shapes
            .iter()
            .map(|&s| {
                let t = Tensor::<A<B>, 2>::random(s, Distribution::Normal(0.0, 0.02), device);
                Param::from_tensor(t.cast(dtype))
            })
            .collect(),
    };
    let grads: Vec<Tensor<Inner<B>, 2>> = shapes
        .iter()
        .map(|&s| {
            Tensor::<Inner<B>, 2>::random(s, Distribution::Normal(0.0, 1e-3), device).cast(dtype)
        })
        .collect();
    let gradients = |w: &Weights<A<B>>, grads: &[Tensor<Inner<B>, 2>]| {
        let mut g = GradientsParams::new();
        for (p, t) in w.w.iter().zip(grads) {
            g.register::<Inner<B>, 2>(p.id, t.clone());
        }
        g
    };
    let e = dtype.size() as u64;
    let bytes = numel as u64 * 7 * e;
    let shape = format!(
        "{} tensors, {:.0}M params",
        shapes.len(),
        numel as f64 / 1e6
    );
    let dname = format!("{dtype:?}").to_lowercase();
    let sync = || B::sync(device).expect("device sync");
    let iters = if args.tiny { 2 } else { 5 };

    let mut fused = AdamWConfig::new()
        .with_weight_decay(0.01)
        .init::<A<B>>()
        .expect("valid settings");
    let mut model = Some(weights.clone());
    let t = median_seconds(
        args.samples,
        iters,
        |_| {
            let w = model.take().expect("the model");
            let g = gradients(&w, &grads);
            model = Some(fused.step(1e-5, w, g));
        },
        sync,
    );
    report.push("adamw", &shape, &dname, "step", "bastile", t, bytes);

    let mut burns = BurnAdamWConfig::new()
        .with_epsilon(1e-8)
        .with_weight_decay(0.01)
        .init::<A<B>, Weights<A<B>>>();
    let mut model = Some(weights);
    let t = median_seconds(
        args.samples,
        iters,
        |_| {
            let w = model.take().expect("the model");
            let g = clip_grad_norm(&w, gradients(&w, &grads), 1.0);
            model = Some(burns.step(1e-5, w, g));
        },
        sync,
    );
    report.push("adamw", &shape, &dname, "step", "burn", t, bytes);
}
