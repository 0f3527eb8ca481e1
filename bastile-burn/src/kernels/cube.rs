//! Direct launches on `CubeBackend`: make the inputs contiguous, allocate
//! the outputs, run the autotuned kernel.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Device, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use bastile_cubecl::launch::gcd;
use bastile_cubecl::rms_norm::{self, BackwardBuffers, ForwardBuffers, RmsNormProblem, Rows};

use super::{KernelBackend, kernel_dtype};
use crate::RmsNormCast;

/// `(rows, row stride)` when the tensor is a stack of unit-stride rows of
/// its last dimension, evenly spaced (CubeCL's optimized layouts pad the
/// row pitch, so the stride can exceed the row length).
fn row_layout(shape: &Shape, strides: &[usize]) -> Option<(usize, usize)> {
    let d = shape.num_dims();
    let hidden = shape[d - 1];
    if hidden > 1 && strides[d - 1] != 1 {
        return None;
    }
    let rows = shape.num_elements() / hidden.max(1);
    let mut pitch = None;
    let mut expected = 0;
    for i in (0..d - 1).rev().filter(|&i| shape[i] > 1) {
        match pitch {
            None => {
                pitch = Some(strides[i]);
                expected = strides[i] * shape[i];
            }
            Some(_) if strides[i] != expected => return None,
            Some(_) => expected *= shape[i],
        }
    }
    let pitch = pitch.unwrap_or(hidden);
    (pitch >= hidden).then_some((rows, pitch))
}

/// The row alignment (in elements) the kernels are promised: 16 bytes, or
/// less when `hidden` itself is not a multiple of that.
fn row_alignment(hidden: usize, elem_size: usize) -> usize {
    gcd(hidden, 16 / elem_size)
}

/// The tensor as evenly spaced, aligned rows; copied into a fresh layout
/// only when its strides do not allow that.
fn as_rows<R: CubeRuntime>(t: CubeTensor<R>) -> (CubeTensor<R>, Rows) {
    let shape = t.shape();
    let align = row_alignment(*shape.last().expect("rank >= 1"), t.dtype.size());
    let aligned = |t: &CubeTensor<R>| {
        row_layout(&t.shape(), t.meta.strides()).filter(|&(_, stride)| stride.is_multiple_of(align))
    };
    let t = if aligned(&t).is_some() {
        t
    } else {
        into_contiguous(t)
    };
    let (_, stride) = aligned(&t).expect("a contiguous copy is aligned, evenly spaced rows");
    let rows = Rows {
        handle: t.handle.clone(),
        stride,
    };
    (t, rows)
}

fn problem<R: CubeRuntime>(
    x: &CubeTensor<R>,
    eps: f64,
    cast: RmsNormCast,
    rows: &[&Rows],
) -> RmsNormProblem {
    let shape = x.shape();
    let hidden = *shape.last().expect("validated rank >= 1");
    RmsNormProblem {
        rows: shape.num_elements() / hidden,
        hidden,
        eps: eps as f32,
        cast,
        dtype: kernel_dtype(x.dtype).expect("validated dtype"),
        stride_multiple: rows.iter().fold(hidden, |g, r| gcd(g, r.stride)),
    }
}

fn empty_like<R: CubeRuntime>(x: &CubeTensor<R>, shape: Shape, dtype: DType) -> CubeTensor<R> {
    empty_device_dtype(x.client.clone(), x.device.clone(), shape, dtype)
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> KernelBackend
    for CubeBackend<R, F, I, BT>
{
    fn rms_norm_supported(device: &Device<Self>, hidden: usize, dtype: DType) -> bool {
        let Some(dtype) = kernel_dtype(dtype) else {
            return false;
        };
        let client = R::client(device);
        let probe = RmsNormProblem {
            rows: 1,
            hidden,
            eps: 1e-6,
            cast: RmsNormCast::Llama,
            dtype,
            stride_multiple: row_alignment(hidden, dtype.size()),
        };
        rms_norm::supported(&client, device, &probe)
    }

    fn rms_norm_forward_kernel(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        eps: f64,
        cast: RmsNormCast,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
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
        rms_norm::forward(&x.client, &x.device, &problem, &buffers).unwrap_or_else(|e| {
            panic!("RMSNorm forward launch after a positive support check: {e}")
        });
        (out, rstd)
    }

    fn rms_norm_backward_kernel(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        cast: RmsNormCast,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
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
        rms_norm::backward(&x.client, &x.device, &problem, &buffers).unwrap_or_else(|e| {
            panic!("RMSNorm backward launch after a positive support check: {e}")
        });
        (dx, dgamma)
    }
}
