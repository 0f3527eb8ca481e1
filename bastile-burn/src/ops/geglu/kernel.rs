//! GPT-OSS GEGLU's kernel launches on `CubeBackend`.

use burn::tensor::TensorMetadata;
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;

use bastile_cubecl::geglu::{self, GegluBackwardBuffers, GegluForwardBuffers, GegluProblem};
use bastile_cubecl::rows::Rows;

use super::{GegluOss, GegluOssBackward};
use crate::fused::cube::{as_rows, empty_like, rows_cols, stride_multiple};
use crate::fused::{kernel, kernel_dtype, unpack};
use crate::launch_failure::launch;

kernel!(GegluOss, "bastile_geglu_forward", |op, floats, _| {
    let [x] = unpack(floats);
    vec![forward(x, op.alpha, op.limit)]
});

kernel!(
    GegluOssBackward,
    "bastile_geglu_backward",
    |op, floats, _| {
        let [x, dout] = unpack(floats);
        vec![backward(x, dout, op.alpha, op.limit)]
    }
);

fn problem<R: CubeRuntime>(
    x: &CubeTensor<R>,
    alpha: f64,
    limit: f64,
    rows: &[&Rows],
) -> GegluProblem {
    let (n, width) = rows_cols(&x.shape());
    let inter = width / 2;
    GegluProblem {
        rows: n,
        inter,
        alpha: alpha as f32,
        limit: limit as f32,
        dtype: kernel_dtype(x.dtype).expect("validated dtype"),
        stride_multiple: stride_multiple(inter, rows),
    }
}

fn forward<R: CubeRuntime>(x: CubeTensor<R>, alpha: f64, limit: f64) -> CubeTensor<R> {
    let (x, x_rows) = as_rows(x);
    let mut shape = x.shape();
    let last = shape.num_dims() - 1;
    shape[last] /= 2;
    let (out, out_rows) = as_rows(empty_like(&x, shape, x.dtype));
    let problem = problem(&x, alpha, limit, &[&x_rows, &out_rows]);
    let buffers = GegluForwardBuffers {
        input: x_rows,
        out: out_rows,
    };
    launch("GEGLU forward", || {
        geglu::forward(&x.client, &x.device, &problem, &buffers)
    });
    out
}

fn backward<R: CubeRuntime>(
    x: CubeTensor<R>,
    dout: CubeTensor<R>,
    alpha: f64,
    limit: f64,
) -> CubeTensor<R> {
    let (x, x_rows) = as_rows(x);
    let (_dout, dout_rows) = as_rows(dout);
    let (dx, dx_rows) = as_rows(empty_like(&x, x.shape(), x.dtype));
    let problem = problem(&x, alpha, limit, &[&x_rows, &dout_rows, &dx_rows]);
    let buffers = GegluBackwardBuffers {
        input: x_rows,
        dout: dout_rows,
        dinput: dx_rows,
    };
    launch("GEGLU backward", || {
        geglu::backward(&x.client, &x.device, &problem, &buffers)
    });
    dx
}
