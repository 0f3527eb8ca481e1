//! The router choice's kernel launch on `CubeBackend`.

use burn::tensor::{DType, Element, Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::cast;
use burn_cubecl::tensor::CubeTensor;

use bastile_cubecl::router::{self, TopKBuffers, TopKProblem};

use super::RouterTopK;
use crate::fused::cube::{as_rows, empty_like, rows_cols};
use crate::fused::{kernel, kernel_dtype, unpack};
use crate::launch_failure::launch;

kernel!(RouterTopK, "bastile_router_top_k", |op, floats, _| {
    let [logits] = unpack(floats);
    let (weights, chosen) = top_k::<R>(logits, op.k);
    vec![weights, cast(chosen, <I as Element>::dtype())]
});

/// The weights and the chosen experts (i32).
fn top_k<R: CubeRuntime>(logits: CubeTensor<R>, k: usize) -> (CubeTensor<R>, CubeTensor<R>) {
    let (logits, logit_rows) = as_rows(logits);
    let (tokens, experts) = rows_cols(&logits.shape());
    let shape = Shape::new([tokens, k]);
    let weights = empty_like(&logits, shape.clone(), logits.dtype);
    let chosen = empty_like(&logits, shape, DType::I32);
    let problem = TopKProblem {
        rows: tokens,
        experts,
        k,
        dtype: kernel_dtype(logits.dtype).expect("validated dtype"),
    };
    let buffers = TopKBuffers {
        logits: logit_rows,
        weights: weights.handle.clone(),
        indices: chosen.handle.clone(),
    };
    launch("router top-k", || {
        router::top_k_softmax(&logits.client, &problem, &buffers)
    });
    (weights, chosen)
}
