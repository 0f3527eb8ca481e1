//! GPT-OSS expert activation (clamped GEGLU): the checked public entry
//! point, the composite reference and the fused op's declaration; its
//! autodiff node in `autodiff.rs`, its kernel launches in `kernel.rs`.
//!
//! Semantics (HF transformers `GptOssExperts`): the last dimension holds
//! gate and up interleaved (`[..., ::2]` gate, `[..., 1::2]` up);
//! `g = min(gate, limit)`, `u = clamp(up, −limit, limit)`,
//! `out = (u + 1) · g · sigmoid(alpha · g)`, in the input dtype. Backward
//! zeroes each gradient where its clamp is active, passing it at exactly
//! ±limit (torch.clamp's rule).

mod autodiff;
mod kernel;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Device, Distribution, Tensor, TensorMetadata};

use crate::fused::{DTypeQuery, In, KernelBackend, Out, TensorSpec, fused_op, unpack};
use crate::ops::{check_float, float};
use crate::patches::Op;
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
    let op = GegluOss { alpha, limit };
    Ok(float(B::run(&op, gate_up.into_primitive().tensor())))
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

/// GPT-OSS's GEGLU forward over interleaved `gate_up`.
#[derive(Clone, Copy, Debug)]
pub struct GegluOss {
    pub alpha: f64,
    pub limit: f64,
}

/// Its backward: `(gate_up, dout)` to the interleaved input gradient.
#[derive(Clone, Copy, Debug)]
pub struct GegluOssBackward {
    pub alpha: f64,
    pub limit: f64,
}

fn problem_of<B: Backend>(x: &FloatTensor<B>) -> (Device<B>, DTypeQuery) {
    (B::float_device(x), DTypeQuery { dtype: x.dtype() })
}

fused_op! {
    GegluOss: Some(Op::Geglu), F => F, differentiable,
    |_, x| -> DTypeQuery { problem_of::<B>(x) }

    fn composite<B: Backend>(&self, x: In<Self, B>) -> Out<Self, B> {
        composite_forward::<B>(x, self.alpha, self.limit)
    }

    fn kernels<K: KernelBackend>(&self, _: (), x: In<Self, K>) -> Out<Self, K> {
        let mut shape = x.shape();
        let last = shape.num_dims() - 1;
        shape[last] /= 2;
        let outputs = vec![TensorSpec::new(shape, x.dtype())];
        let [out] = unpack(K::launch(self, vec![x], vec![], outputs));
        out
    }
}

fused_op! {
    GegluOssBackward: Some(Op::Geglu), (F, F) => F,
    |_, (x, _)| -> DTypeQuery { problem_of::<B>(x) }

    fn composite<B: Backend>(&self, (x, dout): In<Self, B>) -> Out<Self, B> {
        composite_backward::<B>(x, dout, self.alpha, self.limit)
    }

    fn kernels<K: KernelBackend>(&self, _: (), (x, dout): In<Self, K>) -> Out<Self, K> {
        let outputs = vec![TensorSpec::of(&x)];
        let [dx] = unpack(K::launch(self, vec![x, dout], vec![], outputs));
        dx
    }
}

/// Compiles (and autotunes) the GEGLU kernels for GPT-OSS's expert width.
pub(crate) fn warmup<B: BastileBackend>(device: &B::Device) {
    let x = Tensor::<B, 2>::random([256, 2 * 2880], Distribution::Normal(0.0, 3.0), device);
    let x = x.into_primitive().tensor();
    let (alpha, limit) = (GEGLU_OSS_ALPHA, GEGLU_OSS_LIMIT);
    let out = B::run(&GegluOss { alpha, limit }, x.clone());
    let _ = B::run(&GegluOssBackward { alpha, limit }, (x, out));
    let _ = B::sync(device);
}
