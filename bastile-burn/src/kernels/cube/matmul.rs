//! Matmul on `CubeBackend`: cuBLASLt on the CUDA runtime, the inner
//! backend's own matmul everywhere else and for whatever cuBLASLt declines.

use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use crate::kernels::kernel_dtype;

/// Whether cuBLASLt takes `dtype` on `device`: only for the CUDA runtime,
/// and only once the library has loaded there.
pub(super) fn supported<R: CubeRuntime>(device: &R::Device, dtype: DType) -> bool {
    kernel_dtype(dtype).is_some() && cuda::device_index::<R>(device).is_some_and(cuda::available)
}

/// `lhs · rhs` written in `out_dtype` (the operands' or f32) on cuBLASLt
/// when the `matmul` patch is on and cuBLASLt takes it; `None` otherwise
/// (the caller keeps its own matmul). For kernels that multiply inside a
/// larger op, such as the fused linear cross-entropy's chunks.
pub(crate) fn matmul_blas<R: CubeRuntime>(
    lhs: &CubeTensor<R>,
    rhs: &CubeTensor<R>,
    out_dtype: DType,
) -> Option<CubeTensor<R>> {
    if !crate::patches::is_enabled(crate::patches::Op::Matmul) {
        return None;
    }
    cuda::matmul(lhs, rhs, None, out_dtype)
}

/// `lhs · rhs (+ bias over the last dimension)`.
pub(super) fn matmul<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    lhs: CubeTensor<R>,
    rhs: CubeTensor<R>,
    bias: Option<CubeTensor<R>>,
) -> CubeTensor<R> {
    match cuda::matmul(&lhs, &rhs, bias.as_ref(), lhs.dtype) {
        Some(out) => out,
        None => {
            type Inner<R, F, I, BT> = CubeBackend<R, F, I, BT>;
            let out = Inner::<R, F, I, BT>::float_matmul(lhs, rhs);
            match bias {
                Some(bias) => {
                    let mut shape = vec![1; out.shape().num_dims()];
                    *shape.last_mut().expect("rank >= 2") = bias.shape().num_elements();
                    let bias = Inner::<R, F, I, BT>::float_reshape(bias, Shape::from(shape));
                    Inner::<R, F, I, BT>::float_add(out, bias)
                }
                None => out,
            }
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use core::any::Any;

    use burn::tensor::TensorMetadata;
    use burn_cubecl::CubeRuntime;
    use burn_cubecl::kernel::into_contiguous;
    use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
    use burn_cubecl::tensor::CubeTensor;
    use cubecl::cuda::{CudaDevice, CudaRuntime};
    use cubecl::prelude::ComputeClient;

    use bastile_cubecl::KernelError;
    use bastile_cubecl::cublaslt::{self, GemmBuffers, GemmDtypes};
    use bastile_cubecl::gemm_layout::{GemmPlan, PlanError, plan_matmul};

    use crate::kernels::kernel_dtype;

    pub fn device_index<R: CubeRuntime>(device: &R::Device) -> Option<usize> {
        (device as &dyn Any)
            .downcast_ref::<CudaDevice>()
            .map(|d| d.index)
    }

    pub fn available(index: usize) -> bool {
        cublaslt::available(index)
    }

    fn plan<R: CubeRuntime>(
        lhs: &CubeTensor<R>,
        rhs: &CubeTensor<R>,
    ) -> Result<GemmPlan, PlanError> {
        plan_matmul(
            &lhs.shape(),
            lhs.meta.strides(),
            &rhs.shape(),
            rhs.meta.strides(),
        )
    }

    /// `None` when this is not the CUDA runtime or cuBLASLt declines the
    /// problem; the caller then takes the inner backend's matmul.
    pub fn matmul<R: CubeRuntime>(
        lhs: &CubeTensor<R>,
        rhs: &CubeTensor<R>,
        bias: Option<&CubeTensor<R>>,
        out_dtype: burn::tensor::DType,
    ) -> Option<CubeTensor<R>> {
        let index = device_index::<R>(&lhs.device)?;
        let client = (&lhs.client as &dyn Any).downcast_ref::<ComputeClient<CudaRuntime>>()?;
        let dtypes = GemmDtypes {
            operands: kernel_dtype(lhs.dtype)?,
            out: kernel_dtype(out_dtype)?,
        };
        if rhs.dtype != lhs.dtype || bias.is_some_and(|b| b.dtype != lhs.dtype) {
            return None;
        }
        // Strides BLAS cannot read in place (broadcast rows, scattered
        // batches) are copied once into a contiguous layout.
        let (lhs, rhs, plan) = match plan(lhs, rhs) {
            Ok(p) => (lhs.clone(), rhs.clone(), p),
            Err(PlanError::Layout(_)) => {
                let (l, r) = (into_contiguous(lhs.clone()), into_contiguous(rhs.clone()));
                let p = plan(&l, &r).ok()?;
                (l, r, p)
            }
            // The inner backend reports mismatched shapes its usual way.
            Err(PlanError::Shape(_)) => return None,
        };
        let bias = bias.map(|b| into_contiguous(b.clone()));
        let out = empty_device_contiguous_dtype(
            lhs.client.clone(),
            lhs.device.clone(),
            plan.out_shape.clone().into(),
            out_dtype,
        );
        let buffers = GemmBuffers {
            lhs: &lhs.handle,
            rhs: &rhs.handle,
            bias: bias.as_ref().map(|b| &b.handle),
            out: &out.handle,
        };
        match cublaslt::gemm(client, index, dtypes, &plan, buffers) {
            Ok(()) => Some(out),
            Err(KernelError::Unsupported(_)) => None,
            Err(e) => panic!("cuBLASLt matmul failed: {e}"),
        }
    }
}

#[cfg(not(feature = "cuda"))]
mod cuda {
    use burn_cubecl::CubeRuntime;
    use burn_cubecl::tensor::CubeTensor;

    pub fn device_index<R: CubeRuntime>(_device: &R::Device) -> Option<usize> {
        None
    }

    pub fn available(_index: usize) -> bool {
        false
    }

    pub fn matmul<R: CubeRuntime>(
        _lhs: &CubeTensor<R>,
        _rhs: &CubeTensor<R>,
        _bias: Option<&CubeTensor<R>>,
        _out_dtype: burn::tensor::DType,
    ) -> Option<CubeTensor<R>> {
        None
    }
}
