//! Direct launches on `CubeBackend`: make the inputs contiguous, allocate
//! the outputs, run the autotuned kernel.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Device, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use bastile_cubecl::rms_norm::{self, BackwardBuffers, ForwardBuffers, RmsNormProblem};

use super::{KernelBackend, kernel_dtype};
use crate::RmsNormCast;

fn problem<R: CubeRuntime>(x: &CubeTensor<R>, eps: f64, cast: RmsNormCast) -> RmsNormProblem {
    let shape = x.shape();
    let hidden = *shape.last().expect("validated rank >= 1");
    RmsNormProblem {
        rows: shape.num_elements() / hidden,
        hidden,
        eps: eps as f32,
        cast,
        dtype: kernel_dtype(x.dtype).expect("validated dtype"),
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
        };
        !rms_norm::candidates(&client, &probe).is_empty()
    }

    fn rms_norm_forward_kernel(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        eps: f64,
        cast: RmsNormCast,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let x = into_contiguous(x);
        let gamma = into_contiguous(gamma);
        let problem = problem(&x, eps, cast);
        let out = empty_like(&x, x.shape(), x.dtype);
        let rstd = empty_like(&x, Shape::new([problem.rows]), DType::F32);
        let buffers = ForwardBuffers {
            x: x.handle.clone(),
            gamma: gamma.handle.clone(),
            out: out.handle.clone(),
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
        let x = into_contiguous(x);
        let gamma = into_contiguous(gamma);
        let rstd = into_contiguous(rstd);
        let dy = into_contiguous(dy);
        let problem = problem(&x, 0.0, cast);
        let dx = empty_like(&x, x.shape(), x.dtype);
        let dgamma = empty_like(&x, gamma.shape(), gamma.dtype);
        let buffers = BackwardBuffers {
            x: x.handle.clone(),
            gamma: gamma.handle.clone(),
            rstd: rstd.handle.clone(),
            dy: dy.handle.clone(),
            dx: dx.handle.clone(),
            dgamma: dgamma.handle.clone(),
        };
        rms_norm::backward(&x.client, &x.device, &problem, &buffers).unwrap_or_else(|e| {
            panic!("RMSNorm backward launch after a positive support check: {e}")
        });
        (dx, dgamma)
    }
}
