//! A linear layer, `x · W + bias`, as one autodiff node: the checked entry
//! point, the reference math and the op's declarations; the kernels'
//! launch in `kernel.rs`, the node in `autodiff.rs`.
//!
//! Burn's `linear` under autodiff flattens the input and unflattens the
//! output around its product, and its backward pass does the same around
//! each of two products and transposes their operands: eleven ops of a
//! fusion stream per layer and step, each with its bookkeeping on the
//! host, where the products are the only work the device does. The fused
//! op takes the input of any rank, so those views happen inside one
//! recorded op per pass; the backward computes the input's, the weight's
//! and the bias's gradients in one launch, each only when it is needed (a
//! frozen weight gets none). On cuBLASLt the bias is added in the forward
//! product's epilogue and its gradient (the column sums of `dy`) comes
//! with the weight's product.
//!
//! The same op runs a batch of layers ([`batched_linear`], e.g. a mixture's
//! experts, each on its own rows): one strided batched product per pass,
//! each layer's bias added in the product's epilogue.

mod autodiff;
mod kernel;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Device, Shape, Tensor, TensorMetadata};

use crate::backend::matmul::{RowsOf, rows, with_columns};
use crate::fused::{DTypeQuery, In, KernelBackend, Out, TensorSpec, fused_op};
use crate::ops::{check_float, check_like_input};
use crate::patches::Op;
use crate::{BastileBackend, BastileError};

/// `x · weight + bias` over the last dimension of `x`: Burn's
/// `module::linear`, as one autodiff node under `Autodiff<Bastile<B>>`.
///
/// Errors when the shapes do not chain, a tensor is not floating point or
/// has another dtype than `x`, or the tensors are on different devices.
///
/// # Shapes
///
/// - `x`: `[..., in]`
/// - `weight`: `[in, out]` (Burn's `Linear` layout)
/// - `bias`: `[out]`
/// - output: `[..., out]`, in `x`'s dtype
pub fn linear<B: BastileBackend, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
) -> Result<Tensor<B, D>, BastileError> {
    check_float("the linear input", x.dtype())?;
    let [input, output] = weight.dims();
    let fits = D > 0 && x.dims()[D - 1] == input;
    let bias_fits = bias.as_ref().is_none_or(|b| b.dims() == [output]);
    if !fits || !bias_fits {
        return Err(BastileError::Shape(format!(
            "a linear layer takes x [..., in], weight [in, out] and bias [out], got x {:?}, \
             weight {:?}, bias {:?}",
            x.dims(),
            weight.dims(),
            bias.as_ref().map(|b| b.dims())
        )));
    }
    run_linear(x, weight, bias)
}

/// A batch of linear layers, each on its own rows: `x[l] · weight[l] +
/// bias[l]` for every layer `l`, as one autodiff node under
/// `Autodiff<Bastile<B>>` (one strided batched product per pass; on CUDA
/// each layer's bias is added in the product's epilogue).
///
/// Errors when the shapes do not chain or the layer counts differ, a
/// tensor is not floating point or has another dtype than `x`, or the
/// tensors are on different devices.
///
/// # Shapes
///
/// - `x`: `[layers, rows, in]`
/// - `weight`: `[layers, in, out]`
/// - `bias`: `[layers, out]`
/// - output: `[layers, rows, out]`, in `x`'s dtype
pub fn batched_linear<B: BastileBackend>(
    x: Tensor<B, 3>,
    weight: Tensor<B, 3>,
    bias: Option<Tensor<B, 2>>,
) -> Result<Tensor<B, 3>, BastileError> {
    check_float("the linear input", x.dtype())?;
    let ([layers, _, input], [w_layers, w_input, output]) = (x.dims(), weight.dims());
    let fits = layers == w_layers && input == w_input;
    let bias_fits = bias.as_ref().is_none_or(|b| b.dims() == [layers, output]);
    if !fits || !bias_fits {
        return Err(BastileError::Shape(format!(
            "a batch of linear layers takes x [layers, rows, in], weight [layers, in, out] and \
             bias [layers, out], got x {:?}, weight {:?}, bias {:?}",
            x.dims(),
            weight.dims(),
            bias.as_ref().map(|b| b.dims())
        )));
    }
    run_linear(x, weight, bias)
}

/// Checks the dtypes and devices and runs the op (the shapes are checked).
fn run_linear<B: BastileBackend, const D: usize, const W: usize, const V: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, W>,
    bias: Option<Tensor<B, V>>,
) -> Result<Tensor<B, D>, BastileError> {
    let named = "the linear input";
    check_like_input(named, &x, "the weight", weight.dtype(), &weight.device())?;
    if let Some(bias) = &bias {
        check_like_input(named, &x, "the bias", bias.dtype(), &bias.device())?;
    }
    let input = (
        x.into_primitive().tensor(),
        weight.into_primitive().tensor(),
        bias.map(|b| b.into_primitive().tensor()),
    );
    Ok(crate::ops::float(B::run(&Linear, input)))
}

/// The forward pass, `(x, weight, bias?)` to the output.
#[derive(Clone, Copy, Debug, Default)]
pub struct Linear;

/// The backward pass, `(x, weight, dy)` to `(dx, dW, dbias)`, each
/// computed only when asked for.
#[derive(Clone, Copy, Debug)]
pub struct LinearBackward {
    pub input_grad: bool,
    pub weight_grad: bool,
    pub bias_grad: bool,
}

/// `lhs · rhs` in a dtype and the column sums of each matrix of `rhs`.
type ProductAndSums<B> =
    fn(&FloatTensor<B>, &FloatTensor<B>, DType) -> Option<(FloatTensor<B>, FloatTensor<B>)>;

/// How a backward pass computes its parts on a backend.
struct Passes<B: Backend> {
    /// `lhs · rhs` written in a dtype.
    product: fn(FloatTensor<B>, FloatTensor<B>, DType) -> FloatTensor<B>,
    /// `lhs · rhs` written in a dtype and the column sums of each matrix
    /// of `rhs`, from one product, where the backend can.
    product_and_sums: ProductAndSums<B>,
    /// The column sums of each matrix of a tensor (its rows summed; the
    /// rows' dimension dropped).
    column_sums: fn(FloatTensor<B>) -> FloatTensor<B>,
    rows: RowsOf<B>,
}

fn backward<B: Backend>(
    op: &LinearBackward,
    (x, weight, dy): In<LinearBackward, B>,
    passes: Passes<B>,
) -> Out<LinearBackward, B> {
    let x_shape = x.shape();
    // One layer takes its input of any rank as rows; a batch of layers
    // keeps its `[layers, rows, ·]` batches.
    let batched = is_batched::<B>(&weight);
    let rows = |t| if batched { t } else { (passes.rows)(t) };
    let dy = rows(dy);
    let dx = op.input_grad.then(|| {
        let dx = (passes.product)(dy.clone(), transpose::<B>(weight.clone()), x.dtype());
        B::float_reshape(dx, x_shape)
    });
    let dtype = weight.dtype();
    let (dw, dbias) = match (op.weight_grad, op.bias_grad) {
        (true, true) => {
            // The bias's gradient is `dy`'s column sums: the weight's
            // product reads `dy` once for both where it can.
            let xt = transpose::<B>(rows(x));
            match (passes.product_and_sums)(&xt, &dy, dtype) {
                Some((dw, dbias)) => (Some(dw), Some(dbias)),
                None => {
                    let dw = (passes.product)(xt, dy.clone(), dtype);
                    (Some(dw), Some((passes.column_sums)(dy)))
                }
            }
        }
        (true, false) => (
            Some((passes.product)(transpose::<B>(rows(x)), dy, dtype)),
            None,
        ),
        (false, bias) => (None, bias.then(|| (passes.column_sums)(dy))),
    };
    (dx, dw, dbias)
}

/// Whether `weight` is a batch of layers' weights, `[layers, in, out]`.
fn is_batched<B: Backend>(weight: &FloatTensor<B>) -> bool {
    weight.shape().num_dims() == 3
}

/// The matrices of `t` transposed (a view).
fn transpose<B: Backend>(t: FloatTensor<B>) -> FloatTensor<B> {
    let rank = t.shape().num_dims();
    B::float_swap_dims(t, rank - 2, rank - 1)
}

/// `shape` without its rows' dimension (the second-to-last): the shape
/// of its matrices' column sums.
fn without_rows(shape: Shape) -> Shape {
    let mut dims = shape.as_slice().to_vec();
    dims.remove(dims.len() - 2);
    Shape::from(dims)
}

/// `x · weight + bias` on `B`'s own ops: Burn's `linear` for one layer, a
/// batched product and a broadcast sum for a batch of them.
fn composite_forward<B: Backend>((x, weight, bias): In<Linear, B>) -> Out<Linear, B> {
    if !is_batched::<B>(&weight) {
        return B::linear(x, weight, bias);
    }
    let y = B::float_matmul(x, weight);
    match bias {
        Some(bias) => {
            let [layers, out] = bias.shape().dims();
            B::float_add(y, B::float_reshape(bias, Shape::new([layers, 1, out])))
        }
        None => y,
    }
}

fn burn_product<B: Backend>(lhs: FloatTensor<B>, rhs: FloatTensor<B>, _: DType) -> FloatTensor<B> {
    B::float_matmul(lhs, rhs)
}

fn burn_column_sums<B: Backend>(t: FloatTensor<B>) -> FloatTensor<B> {
    let shape = t.shape();
    let summed = B::float_sum_dim(t, shape.num_dims() - 2);
    B::float_reshape(summed, without_rows(shape))
}

fn problem_of<B: Backend>(x: &FloatTensor<B>) -> (Device<B>, DTypeQuery) {
    (B::float_device(x), DTypeQuery { dtype: x.dtype() })
}

fused_op! {
    Linear: Some(Op::Matmul), (F, F, Option<F>) => F, differentiable,
    |_, (x, ..)| -> DTypeQuery { problem_of::<B>(x) }

    fn composite<B: Backend>(&self, input: In<Self, B>) -> Out<Self, B> {
        composite_forward::<B>(input)
    }

    fn kernels<K: KernelBackend>(&self, _: (), (x, weight, bias): In<Self, K>) -> Out<Self, K> {
        let shape = with_columns(x.shape(), weight.shape()[weight.shape().num_dims() - 1]);
        let outputs = vec![TensorSpec::new(shape, x.dtype())];
        let launch = kernel::LinearForward { has_bias: bias.is_some() };
        let floats = [Some(x), Some(weight), bias].into_iter().flatten().collect();
        let [y] = crate::fused::unpack(K::launch(&launch, floats, vec![], outputs));
        y
    }
}

fused_op! {
    LinearBackward: Some(Op::Matmul), (F, F, F) => (Option<F>, Option<F>, Option<F>),
    |_, (x, ..)| -> DTypeQuery { problem_of::<B>(x) }

    fn composite<B: Backend>(&self, input: In<Self, B>) -> Out<Self, B> {
        let passes = Passes {
            product: burn_product::<B>,
            product_and_sums: |_, _, _| None,
            column_sums: burn_column_sums::<B>,
            rows: rows::<B>,
        };
        backward::<B>(self, input, passes)
    }

    fn kernels<K: KernelBackend>(&self, _: (), (x, weight, dy): In<Self, K>) -> Out<Self, K> {
        let mut outputs = vec![];
        if self.input_grad {
            outputs.push(TensorSpec::of(&x));
        }
        if self.weight_grad {
            outputs.push(TensorSpec::of(&weight));
        }
        if self.bias_grad {
            outputs.push(TensorSpec::new(without_rows(weight.shape()), weight.dtype()));
        }
        if outputs.is_empty() {
            return (None, None, None);
        }
        let launch = kernel::LinearBackwardKernel { op: *self };
        let mut grads = K::launch(&launch, vec![x, weight, dy], vec![], outputs).into_iter();
        let dx = self.input_grad.then(|| grads.next().expect("dx"));
        let dw = self.weight_grad.then(|| grads.next().expect("dW"));
        let dbias = self.bias_grad.then(|| grads.next().expect("dbias"));
        (dx, dw, dbias)
    }
}
