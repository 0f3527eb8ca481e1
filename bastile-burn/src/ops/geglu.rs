//! GPT-OSS expert activation (clamped GEGLU): the checked public entry
//! point, the composite reference, and the autodiff node of the fused op.
//!
//! Semantics (HF transformers `GptOssExperts`): the last dimension holds
//! gate and up interleaved (`[..., ::2]` gate, `[..., 1::2]` up);
//! `g = min(gate, limit)`, `u = clamp(up, −limit, limit)`,
//! `out = (u + 1) · g · sigmoid(alpha · g)`, in the input dtype. Backward
//! zeroes each gradient where its clamp is active, passing it at exactly
//! ±limit (torch.clamp's rule).

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Distribution, Tensor, TensorMetadata};
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};

use crate::ops::{check_float, float};
use crate::{BastileBackend, BastileError};

/// GPT-OSS's default `alpha`.
pub const GEGLU_OSS_ALPHA: f64 = 1.702;
/// GPT-OSS's default `limit` (`swiglu_limit` in its config).
pub const GEGLU_OSS_LIMIT: f64 = 7.0;

/// The clamped GEGLU of GPT-OSS's experts over interleaved `gate_up`; the
/// output's last dimension is half as wide.
///
/// Errors when the last dimension is odd, the dtype is not floating point,
/// `alpha` is not finite or `limit` is negative or not finite.
///
/// # Shapes
///
/// - `gate_up`: `[..., 2·d]`, gate and up interleaved (`gate_up[..., 2i]` the gate, `gate_up[..., 2i + 1]` the up projection)
/// - output: `[..., d]`
pub fn geglu_oss<B: BastileBackend, const D: usize>(
    gate_up: Tensor<B, D>,
    alpha: f64,
    limit: f64,
) -> Result<Tensor<B, D>, BastileError> {
    check_float("GEGLU gate_up", gate_up.dtype())?;
    let dims = gate_up.dims();
    if D == 0 || !dims[D - 1].is_multiple_of(2) {
        return Err(BastileError::Shape(format!(
            "GEGLU needs an even last dimension (interleaved gate, up), got shape {dims:?}"
        )));
    }
    if !(alpha.is_finite() && limit.is_finite() && limit >= 0.0) {
        return Err(BastileError::Config(format!(
            "GEGLU needs a finite alpha and a finite, non-negative limit, got alpha {alpha}, limit {limit}"
        )));
    }
    Ok(float(B::geglu_oss(
        gate_up.into_primitive().tensor(),
        alpha,
        limit,
    )))
}

/// `(gate, up)` as `[rows, inter]` tensors (strided views of the input).
fn split<B: Backend>(x: FloatTensor<B>) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let shape = x.shape();
    let width = *shape.last().expect("rank >= 1");
    let rows = shape.num_elements() / width.max(1);
    let inter = width / 2;
    let t = float::<B, 3>(B::float_reshape(x, [rows, inter, 2].into()));
    (
        t.clone()
            .slice([0..rows, 0..inter, 0..1])
            .reshape([rows, inter]),
        t.slice([0..rows, 0..inter, 1..2]).reshape([rows, inter]),
    )
}

/// Reference forward with plain Burn ops, in the input dtype.
pub fn composite_forward<B: Backend>(x: FloatTensor<B>, alpha: f64, limit: f64) -> FloatTensor<B> {
    let mut shape = x.shape();
    let (gate, up) = split::<B>(x);
    let g = gate.clamp_max(limit);
    let u = up.clamp(-limit, limit);
    let glu = g.clone() * burn::tensor::activation::sigmoid(g * alpha);
    let out = (u + 1.0) * glu;
    let last = shape.num_dims() - 1;
    shape[last] /= 2;
    B::float_reshape(out.into_primitive().tensor(), shape)
}

/// Reference backward with plain Burn ops: the interleaved input gradient.
pub fn composite_backward<B: Backend>(
    x: FloatTensor<B>,
    dout: FloatTensor<B>,
    alpha: f64,
    limit: f64,
) -> FloatTensor<B> {
    let shape = x.shape();
    let (gate, up) = split::<B>(x);
    let d = float::<B, 2>(dout).reshape(gate.dims());
    let g = gate.clone().clamp_max(limit);
    let u = up.clone().clamp(-limit, limit);
    let s = burn::tensor::activation::sigmoid(g.clone() * alpha);
    let glu = g.clone() * s.clone();
    let du = d.clone() * glu;
    let dglu = d * (u + 1.0);
    let dz = dglu.clone() * g * s.clone() * (s.clone().neg() + 1.0);
    let dg = dglu * s + dz * alpha;
    let dg = dg.mask_fill(gate.greater_elem(limit), 0.0);
    let du = du.mask_fill(up.clone().greater_elem(limit), 0.0);
    let du = du.mask_fill(up.lower_elem(-limit), 0.0);
    let [rows, inter] = dg.dims();
    let both = Tensor::stack::<3>(vec![dg, du], 2).reshape([rows, 2 * inter]);
    B::float_reshape(both.into_primitive().tensor(), shape)
}

#[derive(Debug)]
struct GegluBackward;

impl<B: BastileBackend> Backward<B, 1> for GegluBackward {
    type State = (FloatTensor<B>, f64, f64);

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node] = ops.parents;
        let dout = grads.consume::<B>(&ops.node);
        let (x, alpha, limit) = ops.state;
        let dx = B::geglu_oss_backward(x, dout, alpha, limit);
        if let Some(node) = node {
            grads.register::<B>(node.id, dx);
        }
    }
}

/// `Autodiff<B>`'s GEGLU: one node saving only the input, whose backward is
/// `B`'s fused backward; the composite graph when `B` does not fuse it.
pub(crate) fn autodiff<B: BastileBackend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    alpha: f64,
    limit: f64,
) -> FloatTensor<Autodiff<B, C>> {
    if !B::geglu_oss_fused(&B::float_device(&x.primitive), x.primitive.dtype()) {
        return composite_forward::<Autodiff<B, C>>(x, alpha, limit);
    }
    match GegluBackward
        .prepare::<C>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let out = B::geglu_oss(x.primitive.clone(), alpha, limit);
            prep.finish((x.primitive, alpha, limit), out)
        }
        OpsKind::UnTracked(prep) => prep.finish(B::geglu_oss(x.primitive, alpha, limit)),
    }
}

/// Compiles (and autotunes) the GEGLU kernels for GPT-OSS's expert width.
pub(crate) fn warmup<B: BastileBackend>(device: &B::Device) {
    let x = Tensor::<B, 2>::random([256, 2 * 2880], Distribution::Normal(0.0, 3.0), device);
    let x = x.into_primitive().tensor();
    let out = B::geglu_oss(x.clone(), GEGLU_OSS_ALPHA, GEGLU_OSS_LIMIT);
    let _ = B::geglu_oss_backward(x, out, GEGLU_OSS_ALPHA, GEGLU_OSS_LIMIT);
    let _ = B::sync(device);
}
