//! RMSNorm's kernel launches on `CubeBackend`.

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;

use bastile_cubecl::rms_norm::{self, BackwardBuffers, ForwardBuffers, RmsNormProblem};
use bastile_cubecl::rows::Rows;

use super::{RmsNorm, RmsNormBackward};
use crate::RmsNormCast;
use crate::fused::cube::{as_rows, empty_like, row_alignment, rows_cols, stride_multiple};
use crate::fused::{DeviceQuery, kernel, kernel_dtype, unpack};
use crate::launch_failure::launch;

/// Whether the RMSNorm kernels take rows of `hidden` elements of `dtype`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RmsNormQuery {
    pub hidden: usize,
    pub dtype: DType,
}

impl DeviceQuery for RmsNormQuery {
    type Answer = bool;

    fn ask<R: CubeRuntime>(&self, device: &R::Device) -> bool {
        let Some(dtype) = kernel_dtype(self.dtype) else {
            return false;
        };
        let client = R::client(device);
        let probe = RmsNormProblem {
            rows: 1,
            hidden: self.hidden,
            eps: 1e-6,
            cast: RmsNormCast::Llama,
            dtype,
            stride_multiple: row_alignment(self.hidden, dtype.size()),
        };
        rms_norm::supported(&client, device, &probe)
    }
}

kernel!(RmsNorm, "bastile_rms_norm_forward", |op, floats, _| {
    let [x, gamma] = unpack(floats);
    let (y, rstd) = forward(x, gamma, op.eps, op.cast);
    vec![y, rstd]
});

kernel!(
    RmsNormBackward,
    "bastile_rms_norm_backward",
    |op, floats, _| {
        let [x, gamma, rstd, dy] = unpack(floats);
        let (dx, dgamma) = backward(x, gamma, rstd, dy, op.cast);
        vec![dx, dgamma]
    }
);

fn problem<R: CubeRuntime>(
    x: &CubeTensor<R>,
    eps: f64,
    cast: RmsNormCast,
    rows: &[&Rows],
) -> RmsNormProblem {
    let (n, hidden) = rows_cols(&x.shape());
    RmsNormProblem {
        rows: n,
        hidden,
        eps: eps as f32,
        cast,
        dtype: kernel_dtype(x.dtype).expect("validated dtype"),
        stride_multiple: stride_multiple(hidden, rows),
    }
}

fn forward<R: CubeRuntime>(
    x: CubeTensor<R>,
    gamma: CubeTensor<R>,
    eps: f64,
    cast: RmsNormCast,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let (x, x_rows) = as_rows(x);
    let gamma = into_contiguous(gamma);
    let (out, out_rows) = as_rows(empty_like(&x, x.shape(), x.dtype));
    let problem = problem(&x, eps, cast, &[&x_rows, &out_rows]);
    let rstd = empty_like(&x, Shape::new([problem.rows]), DType::F32);
    let buffers = ForwardBuffers {
        x: x_rows,
        gamma: gamma.handle.clone(),
        out: out_rows,
        rstd: rstd.handle.clone(),
    };
    launch("RMSNorm forward", || {
        rms_norm::forward(&x.client, &x.device, &problem, &buffers)
    });
    (out, rstd)
}

fn backward<R: CubeRuntime>(
    x: CubeTensor<R>,
    gamma: CubeTensor<R>,
    rstd: CubeTensor<R>,
    dy: CubeTensor<R>,
    cast: RmsNormCast,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let (x, x_rows) = as_rows(x);
    let gamma = into_contiguous(gamma);
    let rstd = into_contiguous(rstd);
    let (_dy, dy_rows) = as_rows(dy);
    let (dx, dx_rows) = as_rows(empty_like(&x, x.shape(), x.dtype));
    let problem = problem(&x, 0.0, cast, &[&x_rows, &dy_rows, &dx_rows]);
    let dgamma = empty_like(&x, gamma.shape(), gamma.dtype);
    let buffers = BackwardBuffers {
        x: x_rows,
        gamma: gamma.handle.clone(),
        rstd: rstd.handle.clone(),
        dy: dy_rows,
        dx: dx_rows,
        dgamma: dgamma.handle.clone(),
    };
    launch("RMSNorm backward", || {
        rms_norm::backward(&x.client, &x.device, &problem, &buffers)
    });
    (dx, dgamma)
}
