//! The memory-bound fused nodes (RMSNorm, SwiGLU, GEGLU) under Burn's
//! balanced checkpointing: their outputs feed matrix products, whose saved
//! inputs the checkpointer then drops and rebuilds through the nodes'
//! recompute path. The gradients must be those of the run that keeps
//! everything.

use crate::common::*;
use bastile::{Bastile, BastileBackend, RmsNormCast, geglu_oss, rms_norm, swiglu_packed};
use bastile_cubecl::testing::{Rng, assert_close};
use burn::backend::Autodiff;
use burn::tensor::DType;
use burn_autodiff::checkpoint::strategy::{
    BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
};

const ROWS: usize = 9;
const HIDDEN: usize = 32;
const INTER: usize = 24;

/// The loss's gradients `[x, w1, w2, w3, gamma]` of
/// `geglu(swiglu_packed(rms_norm(x, γ) · w1) · w2) · w3 · d`.
fn gradients<X: BastileBackend, C: CheckpointStrategy>(
    inputs: &[Vec<f64>; 6],
    device: &X::Device,
) -> [Vec<f64>; 5] {
    type A<X, C> = Autodiff<X, C>;
    let [x, gamma, w1, w2, w3, d] = inputs;
    let f32 = DType::F32;
    let x = tensor::<A<X, C>, 2>(x, [ROWS, HIDDEN], f32, device).require_grad();
    let gamma = tensor::<A<X, C>, 1>(gamma, [HIDDEN], f32, device).require_grad();
    let w1 = tensor::<A<X, C>, 2>(w1, [HIDDEN, 4 * INTER], f32, device).require_grad();
    let w2 = tensor::<A<X, C>, 2>(w2, [2 * INTER, 2 * INTER], f32, device).require_grad();
    // w3's gradient needs GEGLU's output: the checkpointer rebuilds it.
    let w3 = tensor::<A<X, C>, 2>(w3, [INTER, INTER], f32, device).require_grad();
    let d = tensor::<A<X, C>, 2>(d, [ROWS, INTER], f32, device);
    let normed = rms_norm(x.clone(), gamma.clone(), 1e-6, RmsNormCast::Llama).unwrap();
    let act = swiglu_packed(normed.matmul(w1.clone())).unwrap();
    let out = geglu_oss(act.matmul(w2.clone()), 1.702, 7.0).unwrap();
    let grads = (out.matmul(w3.clone()) * d).sum().backward();
    [&x, &w1, &w2, &w3]
        .map(|t| values(t.grad(&grads).expect("a gradient")))
        .into_iter()
        .chain([values(gamma.grad(&grads).expect("the gamma gradient"))])
        .collect::<Vec<_>>()
        .try_into()
        .expect("five gradients")
}

backend_test! {
    fn balanced_checkpointing_recomputes_the_fused_nodes<B>(device, name, _dtypes) {
        let mut rng = Rng::fresh();
        let seed = rng.seed();
        let inputs = [
            randn(&mut rng, ROWS * HIDDEN, 0.0, 1.0, DType::F32),
            randn(&mut rng, HIDDEN, 1.0, 0.2, DType::F32),
            randn(&mut rng, HIDDEN * 4 * INTER, 0.0, 0.3, DType::F32),
            randn(&mut rng, 4 * INTER * INTER, 0.0, 0.3, DType::F32),
            randn(&mut rng, INTER * INTER, 0.0, 0.3, DType::F32),
            randn(&mut rng, ROWS * INTER, 0.0, 1.0, DType::F32),
        ];
        let kept = gradients::<Bastile<B>, NoCheckpointing>(
            &inputs, device,
        );
        let balanced = gradients::<Bastile<B>, BalancedCheckpointing>(&inputs, device);
        // The composite reference on the CPU: on CUDA, Burn's own f32
        // matmul may take TF32 and round to about 1e-3.
        let composite = gradients::<burn::backend::NdArray, BalancedCheckpointing>(
            &inputs,
            &Default::default(),
        );
        for (i, what) in ["x", "w1", "w2", "w3", "gamma"].into_iter().enumerate() {
            let what = format!("{name}: d{what}");
            // The same kernels on the same values: equal up to summation order.
            assert_close(
                &format!("{what} (balanced)"),
                &balanced[i],
                &kept[i],
                1e-6,
                seed,
            );
            assert_close(
                &format!("{what} (composite)"),
                &balanced[i],
                &composite[i],
                1e-4,
                seed,
            );
        }
    }
}
