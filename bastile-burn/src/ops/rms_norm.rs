//! RMSNorm: the checked public entry point, the composite reference, and
//! the autodiff node of the fused op.
//!
//! Semantics (HF transformers): statistics in f32,
//! `rstd = 1 / sqrt(mean(x32²) + eps)`, then `γ · cast(x32 · rstd)`
//! ([`RmsNormCast::Llama`]) or `cast(γ · x32 · rstd)` ([`RmsNormCast::GptOss`]).

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Distribution, Shape, Tensor, TensorMetadata, TensorPrimitive};
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};

use crate::ops::{check_float, check_same_device, float};
use crate::{BastileBackend, BastileError, RmsNormCast};

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
    let out = B::rms_norm(
        x.into_primitive().tensor(),
        gamma.into_primitive().tensor(),
        eps,
        cast,
    );
    Ok(Tensor::from_primitive(TensorPrimitive::Float(out)))
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

/// The size of the last dimension of a primitive.
pub(crate) fn hidden_of<B: Backend>(x: &FloatTensor<B>) -> usize {
    *x.shape()
        .last()
        .expect("RMSNorm inputs are validated to have rank >= 1")
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
    let rstd = (x32.clone().square().mean_dim(1) + eps).sqrt().recip();
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

/// What the backward pass of the fused node needs: the inputs and `rstd`.
type State<B> = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>, RmsNormCast);

#[derive(Debug)]
struct RmsNormBackward;

impl<B: BastileBackend> Backward<B, 2> for RmsNormBackward {
    type State = State<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node_x, node_gamma] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let (x, gamma, rstd, cast) = ops.state;
        let (dx, dgamma) = B::rms_norm_backward(x, gamma, rstd, dy, cast);
        if let Some(node) = node_x {
            grads.register::<B>(node.id, dx);
        }
        if let Some(node) = node_gamma {
            grads.register::<B>(node.id, dgamma);
        }
    }
}

/// `Autodiff<B>`'s RMSNorm: one node whose backward is `B`'s fused backward
/// when `B` fuses this input, the composite graph otherwise.
pub(crate) fn autodiff<B: BastileBackend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    gamma: FloatTensor<Autodiff<B, C>>,
    eps: f64,
    cast: RmsNormCast,
) -> FloatTensor<Autodiff<B, C>> {
    let device = B::float_device(&x.primitive);
    let hidden = hidden_of::<B>(&x.primitive);
    if !B::rms_norm_fused(&device, hidden, x.primitive.dtype()) {
        return composite_forward::<Autodiff<B, C>>(x, gamma, eps, cast).0;
    }
    // The node saves its inputs and rstd: recomputing the forward would cost
    // as much memory traffic as keeping them.
    match RmsNormBackward
        .prepare::<C>([x.node.clone(), gamma.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (y, rstd) =
                B::rms_norm_forward(x.primitive.clone(), gamma.primitive.clone(), eps, cast);
            prep.finish((x.primitive, gamma.primitive, rstd, cast), y)
        }
        OpsKind::UnTracked(prep) => {
            let (y, _) = B::rms_norm_forward(x.primitive, gamma.primitive, eps, cast);
            prep.finish(y)
        }
    }
}

/// Compiles (and autotunes) the RMSNorm kernels for a few shapes.
pub(crate) fn warmup<B: BastileBackend>(device: &B::Device) {
    for (rows, hidden) in [(64, 128), (256, 1024), (256, 4096)] {
        let x = Tensor::<B, 2>::random([rows, hidden], Distribution::Normal(0.0, 1.0), device);
        let gamma = Tensor::<B, 1>::ones([hidden], device);
        let (y, rstd) = B::rms_norm_forward(
            x.clone().into_primitive().tensor(),
            gamma.clone().into_primitive().tensor(),
            1e-6,
            RmsNormCast::Llama,
        );
        let _ = B::rms_norm_backward(
            x.into_primitive().tensor(),
            gamma.into_primitive().tensor(),
            rstd,
            y,
            RmsNormCast::Llama,
        );
    }
    let _ = B::sync(device);
}
