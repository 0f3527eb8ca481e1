//! A LoRA adapter's update `s · (x · A) · B`: the checked entry point, the
//! reference math (one function for the composite graph and the fused
//! node, differing only in their matrix product) and the op's
//! declarations; its autodiff node in `autodiff.rs`.
//!
//! Built from Burn ops, the update is seven autodiff nodes (the adapters
//! cast to the activations' dtype, the scale, two products and the
//! reshapes around them), each with its bookkeeping on the host; the fused
//! op is one node whose backward computes the three gradients with four
//! products (on cuBLASLt where the matmul patch runs there), from the
//! input and the small `x · A` it keeps. `A` and `B` may be f32 while `x`
//! is half precision: the products run in `x`'s dtype (as under autocast)
//! and the adapters' gradients come back in their own dtype.

mod autodiff;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Device, Tensor, TensorMetadata};

use crate::fused::{DTypeQuery, In, KernelBackend, Out, fused_op};
use crate::ops::{cast_to, check_float, check_same_device, float};
use crate::patches::Op;
use crate::{BastileBackend, BastileError};

/// The LoRA update `scale · (x · a) · b` of every row of `x`.
///
/// Errors when the shapes do not chain, a tensor is not floating point,
/// the tensors are on different devices or `scale` is not finite.
///
/// # Shapes
///
/// - `x`: `[..., in]`
/// - `a`: `[in, rank]`
/// - `b`: `[rank, out]`
/// - output: `[..., out]`, in `x`'s dtype
pub fn lora_update<B: BastileBackend, const D: usize>(
    x: Tensor<B, D>,
    a: Tensor<B, 2>,
    b: Tensor<B, 2>,
    scale: f64,
) -> Result<Tensor<B, D>, BastileError> {
    check_float("the LoRA input", x.dtype())?;
    check_float("LoRA's A", a.dtype())?;
    check_float("LoRA's B", b.dtype())?;
    check_same_device("the LoRA input", &x.device(), "LoRA's A", &a.device())?;
    check_same_device("LoRA's A", &a.device(), "LoRA's B", &b.device())?;
    let mut dims = x.dims();
    let ([input, rank], [rank_b, output]) = (a.dims(), b.dims());
    if D == 0 || dims[D - 1] != input || rank != rank_b || rank == 0 {
        return Err(BastileError::Shape(format!(
            "a LoRA update takes x [..., in], A [in, rank] and B [rank, out] with rank >= 1, \
             got x {dims:?}, A {:?}, B {:?}",
            a.dims(),
            b.dims()
        )));
    }
    if !scale.is_finite() {
        return Err(BastileError::Config(format!(
            "the LoRA scale must be finite, got {scale}"
        )));
    }
    let rows = dims[..D - 1].iter().product();
    let x = x.reshape([rows, input]).into_primitive().tensor();
    let (a, b) = (a.into_primitive().tensor(), b.into_primitive().tensor());
    let (out, _) = B::run(&LoraUpdate { scale }, (x, a, b));
    dims[D - 1] = output;
    Ok(float::<B, 2>(out).reshape(dims))
}

/// A matrix product of two `[m, k]`, `[k, n]` tensors.
type Product<B> = fn(FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>;

/// `A` and `scale · B` in `dtype`, the products' dtype.
fn adapters_in<B: Backend>(
    a: FloatTensor<B>,
    b: FloatTensor<B>,
    scale: f64,
    dtype: DType,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let scaled = B::float_mul_scalar(b, scale.into());
    (cast_to::<B>(a, dtype), cast_to::<B>(scaled, dtype))
}

/// `(scale · (x · a) · b, x · a)` for `x` `[rows, in]`.
fn forward<B: Backend>(
    (x, a, b): (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>),
    scale: f64,
    product: Product<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let (a, b) = adapters_in::<B>(a, b, scale, x.dtype());
    let xa = product(x, a);
    (product(xa.clone(), b), xa)
}

/// The backward pass's input: `(x, A, B, x · A, dy)`.
type BackwardInput<B> = (
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
);

/// `(dx, dA, dB)` from the input, the adapters, the kept `x · a` and the
/// output gradient.
fn backward<B: Backend>(
    (x, a, b, xa, dy): BackwardInput<B>,
    scale: f64,
    product: Product<B>,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let (a_dtype, b_dtype) = (a.dtype(), b.dtype());
    let dy = cast_to::<B>(dy, x.dtype());
    let (a, b) = adapters_in::<B>(a, b, scale, x.dtype());
    let t = |m: FloatTensor<B>| B::float_swap_dims(m, 0, 1);
    // dy · (s·B)ᵀ: the gradient of x · A.
    let dxa = product(dy.clone(), t(b));
    let dx = product(dxa.clone(), t(a));
    let da = cast_to::<B>(product(t(x), dxa), a_dtype);
    let db = B::float_mul_scalar(product(t(xa), dy), scale.into());
    (dx, da, cast_to::<B>(db, b_dtype))
}

/// The update's forward pass; it also returns `x · A` (`[rows, rank]`),
/// which the backward pass reads.
#[derive(Clone, Copy, Debug)]
pub struct LoraUpdate {
    pub scale: f64,
}

/// Its backward: `(x, A, B, x · A, dy)` to `(dx, dA, dB)`.
#[derive(Clone, Copy, Debug)]
pub struct LoraUpdateBackward {
    pub scale: f64,
}

fn problem_of<B: Backend>(x: &FloatTensor<B>) -> (Device<B>, DTypeQuery) {
    (B::float_device(x), DTypeQuery { dtype: x.dtype() })
}

fn blas<K: KernelBackend>(lhs: FloatTensor<K>, rhs: FloatTensor<K>) -> FloatTensor<K> {
    crate::backend::matmul::matmul::<K>(lhs, rhs)
}

fn burn_product<B: Backend>(lhs: FloatTensor<B>, rhs: FloatTensor<B>) -> FloatTensor<B> {
    B::float_matmul(lhs, rhs)
}

fused_op! {
    LoraUpdate: Some(Op::Lora), (F, F, F) => (F, F), differentiable,
    |_, (x, _, _)| -> DTypeQuery { problem_of::<B>(x) }

    fn composite<B: Backend>(&self, input: In<Self, B>) -> Out<Self, B> {
        forward::<B>(input, self.scale, burn_product::<B>)
    }

    fn kernels<K: KernelBackend>(&self, _: (), input: In<Self, K>) -> Out<Self, K> {
        forward::<K>(input, self.scale, blas::<K>)
    }
}

fused_op! {
    LoraUpdateBackward: Some(Op::Lora), (F, F, F, F, F) => (F, F, F),
    |_, (x, _, _, _, _)| -> DTypeQuery { problem_of::<B>(x) }

    fn composite<B: Backend>(&self, input: In<Self, B>) -> Out<Self, B> {
        backward::<B>(input, self.scale, burn_product::<B>)
    }

    fn kernels<K: KernelBackend>(&self, _: (), input: In<Self, K>) -> Out<Self, K> {
        backward::<K>(input, self.scale, blas::<K>)
    }
}
