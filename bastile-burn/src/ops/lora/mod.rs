//! A linear layer with a LoRA adapter, `x · W + bias + s · (x · A) · B`,
//! and the adapter's update alone: the checked entry points, the reference
//! math (one function per pass for the composite graph and the kernels,
//! differing only in how they multiply) and the op's declarations; the
//! kernels' launch in `kernel.rs`, the autodiff node in `autodiff.rs`.
//!
//! Built from Burn ops, a layer with an adapter is ten autodiff nodes (the
//! base product, the adapters cast to the activations' dtype, the scale,
//! two products, the reshapes, the sum), each with its bookkeeping on the
//! host and its own op in a fusion stream. The fused op is one node and
//! one recorded op per pass: the forward pass runs the base product, then
//! adds `s · (x · A) · B` into its output in the second product's epilogue
//! (cuBLASLt's β = 1, the scale as α); the backward pass adds the adapter's
//! share of `dx` into the base's the same way and writes the adapters'
//! gradients straight in their dtype. It keeps the input, the adapters in
//! the activations' dtype and the small `x · A`. `A` and `B` may be f32
//! while `x` is half precision: the products run in `x`'s dtype (as under
//! autocast). The base weight's gradient is computed only when the weight
//! is trained (a LoRA base is frozen).

mod autodiff;
mod kernel;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Device, Shape, Tensor, TensorMetadata};

use crate::backend::matmul::{RowsOf, row_count, rows, with_columns};
use crate::fused::{DTypeQuery, In, KernelBackend, Out, TensorSpec, fused_op, unpack};
use crate::ops::{cast_to, check_float, check_like_input, check_same_device, float};
use crate::patches::Op;
use crate::{BastileBackend, BastileError};

/// A linear layer with a LoRA adapter: `x · weight + bias + scale · (x ·
/// a) · b` for every row of `x`, in `x`'s dtype (the adapters are cast to
/// it for the products). Under `Autodiff<Bastile<B>>` it is one node,
/// whose backward computes the input's and the adapters' gradients (and
/// the weight's and bias's when they are trained).
///
/// Errors when the shapes do not chain, a tensor is not floating point,
/// the weight or bias has another dtype than `x`, the tensors are on
/// different devices or `scale` is not finite.
///
/// # Shapes
///
/// - `x`: `[..., in]`
/// - `weight`: `[in, out]` (Burn's `Linear` layout)
/// - `bias`: `[out]`
/// - `a`: `[in, rank]`
/// - `b`: `[rank, out]`
/// - output: `[..., out]`
pub fn lora_linear<B: BastileBackend, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
    a: Tensor<B, 2>,
    b: Tensor<B, 2>,
    scale: f64,
) -> Result<Tensor<B, D>, BastileError> {
    let [input, output] = weight.dims();
    let named = "the LoRA input";
    check_float(named, x.dtype())?;
    check_like_input(
        named,
        &x,
        "the base weight",
        weight.dtype(),
        &weight.device(),
    )?;
    if let Some(bias) = &bias {
        check_like_input(named, &x, "the base bias", bias.dtype(), &bias.device())?;
    }
    let bias_fits = bias.as_ref().is_none_or(|b| b.dims() == [output]);
    let fits = D > 0 && x.dims()[D - 1] == input && a.dims()[0] == input && b.dims()[1] == output;
    if !fits || !bias_fits {
        return Err(BastileError::Shape(format!(
            "a linear layer with a LoRA adapter takes x [..., in], weight [in, out], \
             bias [out], A [in, rank] and B [rank, out], got x {:?}, weight {:?}, bias {:?}, \
             A {:?}, B {:?}",
            x.dims(),
            weight.dims(),
            bias.as_ref().map(|b| b.dims()),
            a.dims(),
            b.dims()
        )));
    }
    let base = Base {
        weight: weight.into_primitive().tensor(),
        bias: bias.map(|b| b.into_primitive().tensor()),
    };
    run(x, Some(base), a, b, scale)
}

/// A LoRA adapter's update alone, `scale · (x · a) · b` for every row of
/// `x`, in `x`'s dtype: for an input that differs from the base layer's
/// (dropout on the adapter's path); [`lora_linear`] otherwise.
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
    run(x, None, a, b, scale)
}

/// The frozen (or trained) linear layer under an adapter.
struct Base<B: Backend> {
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
}

/// Checks the adapter and runs the op on `x` (of any rank: the op views it
/// as rows, so no reshape node surrounds it).
fn run<B: BastileBackend, const D: usize>(
    x: Tensor<B, D>,
    base: Option<Base<B>>,
    a: Tensor<B, 2>,
    b: Tensor<B, 2>,
    scale: f64,
) -> Result<Tensor<B, D>, BastileError> {
    check_float("the LoRA input", x.dtype())?;
    check_float("LoRA's A", a.dtype())?;
    check_float("LoRA's B", b.dtype())?;
    check_same_device("the LoRA input", &x.device(), "LoRA's A", &a.device())?;
    check_same_device("LoRA's A", &a.device(), "LoRA's B", &b.device())?;
    let dims = x.dims();
    let ([input, rank], [rank_b, _]) = (a.dims(), b.dims());
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
    let x = x.into_primitive().tensor();
    let (weight, bias) = match base {
        Some(Base { weight, bias }) => (Some(weight), bias),
        None => (None, None),
    };
    let (a, b) = (a.into_primitive().tensor(), b.into_primitive().tensor());
    let (out, _) = B::run(&Lora { scale }, (x, weight, bias, a, b));
    Ok(float::<B, D>(out))
}

/// How a pass multiplies two matrices: `scale · lhs · rhs` written in
/// `dtype`, plus `acc` when given.
type Product<B> =
    fn(FloatTensor<B>, FloatTensor<B>, f32, DType, Option<FloatTensor<B>>) -> FloatTensor<B>;

/// How a pass runs the base layer: `x · weight (+ bias)`.
type BaseProduct<B> = fn(FloatTensor<B>, FloatTensor<B>, Option<FloatTensor<B>>) -> FloatTensor<B>;

/// The forward pass: `(y, x · A, A, B)`, the adapters in `x`'s dtype;
/// the products run over `x`'s rows, `y` has `x`'s shape but its last
/// dimension, `x · A` is `[rows, rank]`.
fn forward<B: Backend>(
    (x, weight, bias, a, b): In<Lora, B>,
    scale: f64,
    product: Product<B>,
    base: BaseProduct<B>,
    rows: RowsOf<B>,
) -> Out<Lora, B> {
    let dtype = x.dtype();
    let shape = with_columns(x.shape(), b.shape()[1]);
    let x = rows(x);
    let (a, b) = (cast_to::<B>(a, dtype), cast_to::<B>(b, dtype));
    let xa = product(x.clone(), a.clone(), 1.0, dtype, None);
    let base = weight.map(|w| base(x, w, bias));
    let y = product(xa.clone(), b.clone(), scale as f32, dtype, base);
    (B::float_reshape(y, shape), (xa, a, b))
}

/// The backward pass: `(dx, dA, dB)` in the dtypes of `x`, `A` and `B`.
fn backward<B: Backend>(
    op: &LoraBackward,
    (x, weight, a, b, xa, dy): In<LoraBackward, B>,
    product: Product<B>,
    rows: RowsOf<B>,
) -> Out<LoraBackward, B> {
    let (dtype, x_shape) = (x.dtype(), x.shape());
    let (x, dy) = (rows(x), rows(cast_to::<B>(dy, dtype)));
    let t = |m: FloatTensor<B>| B::float_swap_dims(m, 0, 1);
    // The gradient of x · A: s · dy · Bᵀ.
    let dxa = product(dy.clone(), t(b), op.scale as f32, dtype, None);
    let base = weight.map(|w| product(dy.clone(), t(w), 1.0, dtype, None));
    let dx = product(dxa.clone(), t(a), 1.0, dtype, base);
    let da = product(t(x), dxa, 1.0, op.a_dtype, None);
    let db = product(t(xa), dy, op.scale as f32, op.b_dtype, None);
    (B::float_reshape(dx, x_shape), da, db)
}

/// The composite products: Burn's matmul in the operands' dtype.
fn burn_product<B: Backend>(
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    scale: f32,
    dtype: DType,
    acc: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    let out = B::float_matmul(lhs, rhs);
    let out = if scale == 1.0 {
        out
    } else {
        B::float_mul_scalar(out, f64::from(scale).into())
    };
    let out = cast_to::<B>(out, dtype);
    match acc {
        Some(acc) => B::float_add(acc, out),
        None => out,
    }
}

fn burn_base<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    B::linear(x, weight, bias)
}

/// The forward pass, `(x, weight?, bias?, A, B)` to `(y, (x · A, A, B))`:
/// the output (`x`'s shape with `out` columns) and what the backward pass
/// reads (`x · A` `[rows, rank]` and the adapters in `x`'s dtype).
#[derive(Clone, Copy, Debug)]
pub struct Lora {
    pub scale: f64,
}

/// Its backward, `(x, weight?, A, B, x · A, dy)` (the adapters in `x`'s
/// dtype) to `(dx, dA, dB)`, the adapters' gradients in their own dtypes.
#[derive(Clone, Copy, Debug)]
pub struct LoraBackward {
    pub scale: f64,
    pub a_dtype: DType,
    pub b_dtype: DType,
}

fn problem_of<B: Backend>(x: &FloatTensor<B>) -> (Device<B>, DTypeQuery) {
    (B::float_device(x), DTypeQuery { dtype: x.dtype() })
}

fused_op! {
    Lora: Some(Op::Lora),
    (F, Option<F>, Option<F>, F, F) => (F, (F, F, F)), differentiable,
    |_, (x, ..)| -> DTypeQuery { problem_of::<B>(x) }

    fn composite<B: Backend>(&self, input: In<Self, B>) -> Out<Self, B> {
        forward::<B>(input, self.scale, burn_product::<B>, burn_base::<B>, rows::<B>)
    }

    fn kernels<K: KernelBackend>(&self, _: (), (x, weight, bias, a, b): In<Self, K>) -> Out<Self, K> {
        let dtype = x.dtype();
        let x_shape = x.shape();
        let outputs = vec![
            TensorSpec::new(with_columns(x_shape.clone(), b.shape()[1]), dtype),
            TensorSpec::new(Shape::new([row_count(&x_shape), a.shape()[1]]), dtype),
            TensorSpec::new(a.shape(), dtype),
            TensorSpec::new(b.shape(), dtype),
        ];
        let launch = kernel::LoraForward {
            scale: self.scale,
            has_weight: weight.is_some(),
            has_bias: bias.is_some(),
        };
        let floats = [Some(x), weight, bias, Some(a), Some(b)].into_iter().flatten().collect();
        let [y, xa, a, b] = unpack(K::launch(&launch, floats, vec![], outputs));
        (y, (xa, a, b))
    }
}

fused_op! {
    LoraBackward: Some(Op::Lora),
    (F, Option<F>, F, F, F, F) => (F, F, F),
    |_, (x, ..)| -> DTypeQuery { problem_of::<B>(x) }

    fn composite<B: Backend>(&self, input: In<Self, B>) -> Out<Self, B> {
        backward::<B>(self, input, burn_product::<B>, rows::<B>)
    }

    fn kernels<K: KernelBackend>(&self, _: (), (x, weight, a, b, xa, dy): In<Self, K>) -> Out<Self, K> {
        let outputs = vec![
            TensorSpec::of(&x),
            TensorSpec::new(a.shape(), self.a_dtype),
            TensorSpec::new(b.shape(), self.b_dtype),
        ];
        let launch = kernel::LoraBackwardKernel { op: *self, has_weight: weight.is_some() };
        let floats = [Some(x), weight, Some(a), Some(b), Some(xa), Some(dy)]
            .into_iter()
            .flatten()
            .collect();
        let [dx, da, db] = unpack(K::launch(&launch, floats, vec![], outputs));
        (dx, da, db)
    }
}
