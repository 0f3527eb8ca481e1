//! The embedding gradient's kernel launch on `CubeBackend`.

use burn::tensor::TensorMetadata;
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;

use bastile_cubecl::embedding::{self, EmbeddingGradBuffers, EmbeddingGradProblem};

use super::EmbeddingGrad;
use crate::fused::cube::{as_rows, contiguous_i32, rows_cols, stride_multiple};
use crate::fused::{kernel, kernel_dtype};
use crate::launch_failure::launch;

kernel!(
    EmbeddingGrad,
    "bastile_embedding_grad",
    |_, mut floats, mut ints| {
        let dout = floats.pop().expect("the output gradient");
        let grad = floats.pop().expect("the gradient added into");
        vec![add_rows(grad, ints.pop().expect("the ids"), dout)]
    }
);

/// `grad` with each token's `dout` row added into its id's row: `grad`
/// itself when nothing else holds it (autodiff hands over the weight's
/// gradient), else a copy.
fn add_rows<R: CubeRuntime>(
    grad: CubeTensor<R>,
    ids: CubeTensor<R>,
    dout: CubeTensor<R>,
) -> CubeTensor<R> {
    let grad = if grad.can_mut() { grad } else { grad.copy() };
    let (grad, grad_rows) = as_rows(grad);
    let (_dout, dout_rows) = as_rows(dout);
    let ids = contiguous_i32(ids);
    let (vocab, hidden) = rows_cols(&grad.shape());
    let problem = EmbeddingGradProblem {
        tokens: ids.shape().num_elements(),
        vocab,
        hidden,
        dtype: kernel_dtype(grad.dtype).expect("validated dtype"),
        stride_multiple: stride_multiple(hidden, &[&grad_rows, &dout_rows]),
    };
    let buffers = EmbeddingGradBuffers {
        grad: grad_rows,
        ids: ids.handle.clone(),
        dout: dout_rows,
    };
    launch("embedding gradient", || {
        embedding::add_rows(&grad.client, &problem, &buffers)
    });
    grad
}
