//! Matmul and `linear` on the inner backend's BLAS path (cuBLASLt on
//! CUDA, `kernel.rs`) when the `matmul` patch is on and the backend has
//! one; `B`'s own ops otherwise.

mod kernel;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, TensorMetadata};

use crate::fused::{KernelBackend, TensorSpec, unpack};
use crate::patches::{Op, is_enabled};
use kernel::Matmul;
pub use kernel::MatmulQuery;
#[cfg(feature = "cuda")]
pub(crate) use kernel::{cuda_client, cuda_device_index};
pub(crate) use kernel::{
    matmul as matmul_with_bias, matmul_blas, matmul_blas_into_rows, product,
    product_and_column_sums,
};

fn use_blas<B: KernelBackend>(t: &FloatTensor<B>) -> bool {
    let query = MatmulQuery { dtype: t.dtype() };
    is_enabled(Op::Matmul) && B::ask(&B::float_device(t), &query).unwrap_or(false)
}

/// `lhs · rhs (+ bias)` on the BLAS (Burn's `float_matmul` semantics: equal
/// ranks, batch dimensions broadcast; problems the BLAS declines take the
/// backend's own matmul).
fn blas<B: KernelBackend>(
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    // Burn's tensor API validated the shapes before the backend call.
    let shape = burn_std::calculate_matmul_output(&lhs.shape(), &rhs.shape())
        .expect("matmul shapes validated by the tensor API");
    let outputs = vec![TensorSpec::new(shape, lhs.dtype())];
    let kernel = Matmul {
        has_bias: bias.is_some(),
    };
    let inputs = [lhs, rhs].into_iter().chain(bias).collect();
    let [out] = unpack(B::launch(&kernel, inputs, vec![], outputs));
    out
}

pub(crate) fn matmul<B: KernelBackend>(lhs: FloatTensor<B>, rhs: FloatTensor<B>) -> FloatTensor<B> {
    if use_blas::<B>(&lhs) {
        blas::<B>(lhs, rhs, None)
    } else {
        B::float_matmul(lhs, rhs)
    }
}

/// The rows of a tensor of `shape` `[..., last]`: the product of its
/// leading dimensions.
pub(crate) fn row_count(shape: &Shape) -> usize {
    shape.num_elements() / shape[shape.num_dims() - 1].max(1)
}

/// How a pass views a tensor `[..., last]` as the matrix `[rows, last]`:
/// [`rows`] on any backend, `fused::cube::rows_view` in kernels (which
/// keeps a pitched layout's rows in place).
pub(crate) type RowsOf<B> = fn(FloatTensor<B>) -> FloatTensor<B>;

/// `t` `[..., last]` as the matrix `[rows, last]` (a view).
pub(crate) fn rows<B: Backend>(t: FloatTensor<B>) -> FloatTensor<B> {
    let shape = t.shape();
    let last = shape[shape.num_dims() - 1];
    B::float_reshape(t, Shape::new([row_count(&shape), last]))
}

/// `shape` with its last dimension `columns`: the shape of a product over
/// the rows of a tensor of `shape`.
pub(crate) fn with_columns(mut shape: Shape, columns: usize) -> Shape {
    let last = shape.num_dims() - 1;
    shape[last] = columns;
    shape
}

/// `t` `[rows, n]` back to the rows' `shape`, with its last dimension `n`.
fn unflatten<B: Backend>(t: FloatTensor<B>, shape: Shape) -> FloatTensor<B> {
    let columns = t.shape()[1];
    B::float_reshape(t, with_columns(shape, columns))
}

/// `x [.., in] · weight [in, out] + bias`: one matrix product over every
/// row, the bias added in the BLAS epilogue.
pub(crate) fn linear<B: KernelBackend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    if !use_blas::<B>(&x) {
        return B::linear(x, weight, bias);
    }
    let shape = x.shape();
    unflatten::<B>(blas::<B>(rows::<B>(x), weight, bias), shape)
}

/// `dx = dy [.., out] · weightᵀ`.
pub(crate) fn linear_x_backward<B: KernelBackend>(
    weight: FloatTensor<B>,
    output_grad: FloatTensor<B>,
) -> FloatTensor<B> {
    if !use_blas::<B>(&output_grad) {
        return B::linear_x_backward(weight, output_grad);
    }
    let shape = output_grad.shape();
    let dy = rows::<B>(output_grad);
    let weight_t = B::float_swap_dims(weight, 0, 1);
    unflatten::<B>(blas::<B>(dy, weight_t, None), shape)
}

/// `dweight = xᵀ · dy` over every row at once (one product with K = rows,
/// instead of one per batch entry summed afterwards).
pub(crate) fn linear_weight_backward<B: KernelBackend>(
    x: FloatTensor<B>,
    output_grad: FloatTensor<B>,
) -> FloatTensor<B> {
    if !use_blas::<B>(&x) {
        return B::linear_weight_backward(x, output_grad);
    }
    let (x, dy) = (rows::<B>(x), rows::<B>(output_grad));
    blas::<B>(B::float_swap_dims(x, 0, 1), dy, None)
}
