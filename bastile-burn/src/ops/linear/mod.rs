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
//! recorded op per pass; the backward computes the input's and the
//! weight's gradients in one launch, each only when it is needed (a frozen
//! weight gets none).

mod autodiff;
mod kernel;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Device, Tensor, TensorMetadata};

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

/// The backward pass, `(x, weight, dy)` to `(dx, dW)`, each computed only
/// when asked for.
#[derive(Clone, Copy, Debug)]
pub struct LinearBackward {
    pub input_grad: bool,
    pub weight_grad: bool,
}

/// How a pass multiplies two matrices: `lhs · rhs` written in `dtype`.
type Product<B> = fn(FloatTensor<B>, FloatTensor<B>, DType) -> FloatTensor<B>;

fn backward<B: Backend>(
    op: &LinearBackward,
    (x, weight, dy): In<LinearBackward, B>,
    product: Product<B>,
    rows: RowsOf<B>,
) -> Out<LinearBackward, B> {
    let t = |m: FloatTensor<B>| B::float_swap_dims(m, 0, 1);
    let x_shape = x.shape();
    let dy = rows(dy);
    let dx = op.input_grad.then(|| {
        let dx = product(dy.clone(), t(weight.clone()), x.dtype());
        B::float_reshape(dx, x_shape)
    });
    let dw = op
        .weight_grad
        .then(|| product(t(rows(x)), dy, weight.dtype()));
    (dx, dw)
}

fn burn_product<B: Backend>(lhs: FloatTensor<B>, rhs: FloatTensor<B>, _: DType) -> FloatTensor<B> {
    B::float_matmul(lhs, rhs)
}

fn problem_of<B: Backend>(x: &FloatTensor<B>) -> (Device<B>, DTypeQuery) {
    (B::float_device(x), DTypeQuery { dtype: x.dtype() })
}

fused_op! {
    Linear: Some(Op::Matmul), (F, F, Option<F>) => F, differentiable,
    |_, (x, ..)| -> DTypeQuery { problem_of::<B>(x) }

    fn composite<B: Backend>(&self, (x, weight, bias): In<Self, B>) -> Out<Self, B> {
        B::linear(x, weight, bias)
    }

    fn kernels<K: KernelBackend>(&self, _: (), (x, weight, bias): In<Self, K>) -> Out<Self, K> {
        let shape = with_columns(x.shape(), weight.shape()[1]);
        let outputs = vec![TensorSpec::new(shape, x.dtype())];
        let launch = kernel::LinearForward { has_bias: bias.is_some() };
        let floats = [Some(x), Some(weight), bias].into_iter().flatten().collect();
        let [y] = crate::fused::unpack(K::launch(&launch, floats, vec![], outputs));
        y
    }
}

fused_op! {
    LinearBackward: Some(Op::Matmul), (F, F, F) => (Option<F>, Option<F>),
    |_, (x, ..)| -> DTypeQuery { problem_of::<B>(x) }

    fn composite<B: Backend>(&self, input: In<Self, B>) -> Out<Self, B> {
        backward::<B>(self, input, burn_product::<B>, rows::<B>)
    }

    fn kernels<K: KernelBackend>(&self, _: (), (x, weight, dy): In<Self, K>) -> Out<Self, K> {
        let mut outputs = vec![];
        if self.input_grad {
            outputs.push(TensorSpec::of(&x));
        }
        if self.weight_grad {
            outputs.push(TensorSpec::of(&weight));
        }
        if outputs.is_empty() {
            return (None, None);
        }
        let launch = kernel::LinearBackwardKernel { op: *self };
        let mut grads = K::launch(&launch, vec![x, weight, dy], vec![], outputs).into_iter();
        let dx = self.input_grad.then(|| grads.next().expect("dx"));
        let dw = self.weight_grad.then(|| grads.next().expect("dW"));
        (dx, dw)
    }
}
