//! The LoRA layer's passes on `CubeBackend`, each one custom op of a
//! fusion stream: the reference math of `mod.rs` with its products on
//! cuBLASLt where it takes them (scale and sums in the epilogue), on
//! CubeCL's matmul elsewhere.

use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use super::{LoraBackward, backward, forward};
use crate::backend::matmul::{matmul_with_bias, product};
use crate::fused::cube::rows_view;
use crate::fused::kernel;

fn cube_product<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    lhs: CubeTensor<R>,
    rhs: CubeTensor<R>,
    scale: f32,
    dtype: DType,
    acc: Option<CubeTensor<R>>,
) -> CubeTensor<R> {
    product::<R, F, I, BT>(&lhs, &rhs, scale, dtype, acc)
}

/// The forward pass. Inputs: `x, weight?, bias?, A, B`; outputs: `y, x ·
/// A` and the adapters in `x`'s dtype.
#[derive(Clone, Copy, Debug)]
pub(super) struct LoraForward {
    pub scale: f64,
    pub has_weight: bool,
    pub has_bias: bool,
}

kernel!(LoraForward, "bastile_lora_forward", |op, floats, _| {
    let mut floats = floats.into_iter();
    let mut next = |present: bool| present.then(|| floats.next().expect("a LoRA input"));
    let x = next(true).expect("the input");
    let weight = next(op.has_weight);
    let bias = next(op.has_bias);
    let (a, b) = (next(true).expect("A"), next(true).expect("B"));
    let (y, (xa, a, b)) = forward::<CubeBackend<R, F, I, BT>>(
        (x, weight, bias, a, b),
        op.scale,
        cube_product::<R, F, I, BT>,
        matmul_with_bias::<R, F, I, BT>,
        rows_view::<R>,
    );
    vec![y, xa, a, b]
});

/// The backward pass. Inputs: `x, weight?, A, B, x · A, dy`; outputs:
/// `dx, dA, dB`.
#[derive(Clone, Copy, Debug)]
pub(super) struct LoraBackwardKernel {
    pub op: LoraBackward,
    pub has_weight: bool,
}

kernel!(
    LoraBackwardKernel,
    "bastile_lora_backward",
    |k, floats, _| {
        let mut floats = floats.into_iter();
        let mut next = |present: bool| present.then(|| floats.next().expect("a LoRA input"));
        let x = next(true).expect("the input");
        let weight = next(k.has_weight);
        let [a, b, xa, dy] = [(); 4].map(|_| next(true).expect("a LoRA input"));
        let (dx, da, db) = backward::<CubeBackend<R, F, I, BT>>(
            &k.op,
            (x, weight, a, b, xa, dy),
            cube_product::<R, F, I, BT>,
            rows_view::<R>,
        );
        vec![dx, da, db]
    }
);
