//! RMSNorm: the checked public entry point, the composite reference and
//! the fused op's declaration; its autodiff node in `autodiff.rs`, its
//! kernel launches in `kernel.rs`.
//!
//! Semantics (HF transformers): statistics in f32,
//! `rstd = 1 / sqrt(mean(x32²) + eps)`, then `γ · cast(x32 · rstd)`
//! ([`RmsNormCast::Llama`]) or `cast(γ · x32 · rstd)` ([`RmsNormCast::GptOss`]).

mod autodiff;
mod kernel;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Device, Distribution, Shape, Tensor, TensorMetadata, TensorPrimitive};

use crate::fused::{In, KernelBackend, Out, TensorSpec, fused_op, unpack};
use crate::ops::{check_float, check_same_device, float};
use crate::patches::Op;
use crate::{BastileBackend, BastileError, RmsNormCast};
pub use kernel::RmsNormQuery;

/// RMSNorm over the last dimension of `x`, scaled by `gamma`
/// (`[hidden]`), with the given cast convention.
///
/// Errors when `gamma` does not match the last dimension of `x`, when the
/// dtypes differ or are not floating point, when the tensors are on
/// different devices, or when `eps` is not a positive finite number.
///
/// # Shapes
///
/// - `x`: `[..., hidden]`
/// - `gamma`: `[hidden]`
/// - output: `[..., hidden]`
pub fn rms_norm<B: BastileBackend, const D: usize>(
    x: Tensor<B, D>,
    gamma: Tensor<B, 1>,
    eps: f64,
    cast: RmsNormCast,
) -> Result<Tensor<B, D>, BastileError> {
    check(&x, &gamma, eps)?;
    let input = (x.into_primitive().tensor(), gamma.into_primitive().tensor());
    let (y, _rstd) = B::run(&RmsNorm { eps, cast }, input);
    Ok(Tensor::from_primitive(TensorPrimitive::Float(y)))
}

/// The validation [`rms_norm`] performs.
pub(crate) fn check<B: Backend, const D: usize>(
    x: &Tensor<B, D>,
    gamma: &Tensor<B, 1>,
    eps: f64,
) -> Result<(), BastileError> {
    if D == 0 {
        return Err(BastileError::Shape(
            "RMSNorm needs an input of rank at least 1".into(),
        ));
    }
    let dims = x.dims();
    let hidden = dims[D - 1];
    let [gamma_len] = gamma.dims();
    if hidden == 0 {
        return Err(BastileError::Shape(format!(
            "RMSNorm over an empty last dimension (input shape {dims:?})"
        )));
    }
    if gamma_len != hidden {
        return Err(BastileError::Shape(format!(
            "RMSNorm weight has {gamma_len} elements but the input's last dimension is {hidden} (input shape {dims:?})"
        )));
    }
    let (xd, gd) = (x.dtype(), gamma.dtype());
    check_float("RMSNorm input", xd)?;
    if xd != gd {
        return Err(BastileError::DType(format!(
            "RMSNorm input is {xd:?} but its weight is {gd:?}"
        )));
    }
    check_same_device("RMSNorm input", &x.device(), "its weight", &gamma.device())?;
    if !(eps.is_finite() && eps > 0.0) {
        return Err(BastileError::Config(format!(
            "RMSNorm eps must be positive and finite, got {eps}"
        )));
    }
    Ok(())
}

fn rows_hidden(shape: &Shape) -> (usize, usize) {
    let hidden = *shape.last().expect("rank >= 1");
    (shape.num_elements() / hidden.max(1), hidden)
}

/// Reference forward with plain Burn ops: `(y, rstd)`, `rstd` f32 of one
/// value per row.
pub fn composite_forward<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    eps: f64,
    cast: RmsNormCast,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let shape = x.shape();
    let dtype = x.dtype();
    let (rows, hidden) = rows_hidden(&shape);
    let x32 = float::<B, 2>(x).reshape([rows, hidden]).cast(DType::F32);
    let gamma = float::<B, 1>(gamma).unsqueeze::<2>();
    // A division, not `recip`: a backend may compute `recip` approximately
    // (Burn's NdArray with its "simd" feature uses `rcpps`, up to 2.6e-4
    // relative error measured on an AMD EPYC), and this is the reference.
    let rms = (x32.clone().square().mean_dim(1) + eps).sqrt();
    let rstd = rms.ones_like() / rms;
    let n = x32 * rstd.clone();
    let y = match cast {
        RmsNormCast::Llama => n.cast(dtype) * gamma,
        RmsNormCast::GptOss => (n * gamma.cast(DType::F32)).cast(dtype),
    };
    (
        B::float_reshape(y.into_primitive().tensor(), shape),
        rstd.reshape([rows]).into_primitive().tensor(),
    )
}

/// Reference backward with plain Burn ops: `(dx, dgamma)`.
pub fn composite_backward<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    rstd: FloatTensor<B>,
    dy: FloatTensor<B>,
    cast: RmsNormCast,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let shape = x.shape();
    let dtype = x.dtype();
    let gamma_dtype = gamma.dtype();
    let (rows, hidden) = rows_hidden(&shape);
    let x32 = float::<B, 2>(x).reshape([rows, hidden]).cast(DType::F32);
    let dy32 = float::<B, 2>(dy).reshape([rows, hidden]).cast(DType::F32);
    let gamma32 = float::<B, 1>(gamma).cast(DType::F32).unsqueeze::<2>();
    let rstd = float::<B, 1>(rstd).cast(DType::F32).reshape([rows, 1]);
    let n = x32 * rstd.clone();
    let dn = dy32.clone() * gamma32;
    let mean_dot = (dn.clone() * n.clone()).mean_dim(1);
    let dx = (dn - n.clone() * mean_dot) * rstd;
    let n_used = match cast {
        RmsNormCast::Llama => n.cast(dtype).cast(DType::F32),
        RmsNormCast::GptOss => n,
    };
    let dgamma = (dy32 * n_used)
        .sum_dim(0)
        .reshape([hidden])
        .cast(gamma_dtype);
    (
        B::float_reshape(dx.cast(dtype).into_primitive().tensor(), shape),
        dgamma.into_primitive().tensor(),
    )
}

/// RMSNorm forward: `(y, rstd)`, `rstd` f32 with one value per row (what
/// the backward pass takes).
#[derive(Clone, Copy, Debug)]
pub struct RmsNorm {
    pub eps: f64,
    pub cast: RmsNormCast,
}

/// RMSNorm backward: `(dx, dgamma)` from the forward's inputs `(x, gamma)`,
/// its `rstd` and the output gradient `dy`, in that order.
#[derive(Clone, Copy, Debug)]
pub struct RmsNormBackward {
    pub cast: RmsNormCast,
}

/// The device and problem of an RMSNorm over `x`.
fn problem_of<B: Backend>(x: &FloatTensor<B>) -> (Device<B>, RmsNormQuery) {
    let hidden = *x.shape().last().expect("RMSNorm inputs have rank >= 1");
    let query = RmsNormQuery {
        hidden,
        dtype: x.dtype(),
    };
    (B::float_device(x), query)
}

fused_op! {
    RmsNorm: Some(Op::RmsNorm), (F, F) => (F, F), differentiable,
    |_, (x, _)| -> RmsNormQuery { problem_of::<B>(x) }

    fn composite<B: Backend>(&self, (x, gamma): In<Self, B>) -> Out<Self, B> {
        composite_forward::<B>(x, gamma, self.eps, self.cast)
    }

    fn kernels<K: KernelBackend>(&self, _: (), (x, gamma): In<Self, K>) -> Out<Self, K> {
        let (rows, _) = rows_hidden(&x.shape());
        let rstd = TensorSpec::new(Shape::new([rows]), DType::F32);
        let outputs = vec![TensorSpec::of(&x), rstd];
        let [y, rstd] = unpack(K::launch(self, vec![x, gamma], vec![], outputs));
        (y, rstd)
    }
}

fused_op! {
    RmsNormBackward: Some(Op::RmsNorm), (F, F, F, F) => (F, F),
    |_, (x, ..)| -> RmsNormQuery { problem_of::<B>(x) }

    fn composite<B: Backend>(&self, (x, gamma, rstd, dy): In<Self, B>) -> Out<Self, B> {
        composite_backward::<B>(x, gamma, rstd, dy, self.cast)
    }

    fn kernels<K: KernelBackend>(&self, _: (), input: In<Self, K>) -> Out<Self, K> {
        let (x, gamma, rstd, dy) = input;
        let outputs = vec![TensorSpec::of(&x), TensorSpec::of(&gamma)];
        let [dx, dgamma] = unpack(K::launch(self, vec![x, gamma, rstd, dy], vec![], outputs));
        (dx, dgamma)
    }
}

/// Compiles (and autotunes) the RMSNorm kernels for a few shapes.
pub(crate) fn warmup<B: BastileBackend>(device: &B::Device) {
    let cast = RmsNormCast::Llama;
    for (rows, hidden) in [(64, 128), (256, 1024), (256, 4096)] {
        let x = Tensor::<B, 2>::random([rows, hidden], Distribution::Normal(0.0, 1.0), device);
        let gamma = Tensor::<B, 1>::ones([hidden], device);
        let (x, gamma) = (x.into_primitive().tensor(), gamma.into_primitive().tensor());
        let (y, rstd) = B::run(&RmsNorm { eps: 1e-6, cast }, (x.clone(), gamma.clone()));
        let _ = B::run(&RmsNormBackward { cast }, (x, gamma, rstd, y));
    }
    let _ = B::sync(device);
}
