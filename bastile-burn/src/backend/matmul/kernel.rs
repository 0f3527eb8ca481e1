//! Matmul on `CubeBackend`: cuBLASLt on the CUDA runtime, the inner
//! backend's own matmul everywhere else and for whatever cuBLASLt declines.

use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use crate::fused::{DeviceQuery, kernel, kernel_dtype};

/// Whether cuBLASLt takes `dtype` on a device: only for the CUDA runtime,
/// and only once the library has loaded there.
pub struct MatmulQuery {
    pub dtype: DType,
}

impl DeviceQuery for MatmulQuery {
    type Answer = bool;

    fn ask<R: CubeRuntime>(&self, device: &R::Device) -> bool {
        kernel_dtype(self.dtype).is_some()
            && cuda::device_index::<R>(device).is_some_and(cuda::available)
    }
}

/// The CUDA device ordinal of `device`, and the CUDA client behind a
/// client of it; `None` on any other runtime.
#[cfg(feature = "cuda")]
pub(crate) use cuda::{cuda_client, device_index as cuda_device_index};

/// `lhs · rhs (+ bias)`, the inputs in that order.
#[derive(Clone, Copy, Debug)]
pub(super) struct Matmul {
    pub has_bias: bool,
}

kernel!(Matmul, "bastile_matmul", |op, mut floats, _| {
    let bias = op.has_bias.then(|| floats.pop().expect("the bias input"));
    let rhs = floats.pop().expect("the rhs input");
    let lhs = floats.pop().expect("the lhs input");
    vec![matmul::<R, F, I, BT>(lhs, rhs, bias)]
});

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

/// Writes `lhs · rhs` (`[m, n]`) into rows `first_row .. first_row + m` of
/// `out`, a contiguous `[rows, n]` matrix of the operands' dtype that the
/// caller holds alone, on cuBLASLt under the same conditions as
/// [`matmul_blas`]; `false` when it did not (nothing was written: the
/// caller writes those rows its own way). Saves the caller a product the
/// size of the rows and its copy into `out`.
pub(crate) fn matmul_blas_into_rows<R: CubeRuntime>(
    lhs: &CubeTensor<R>,
    rhs: &CubeTensor<R>,
    out: &CubeTensor<R>,
    first_row: usize,
) -> bool {
    crate::patches::is_enabled(crate::patches::Op::Matmul)
        && cuda::matmul_into_rows(lhs, rhs, out, first_row)
}

/// `scale · lhs · rhs` (matrices, or batches of them) written in `dtype`,
/// plus `acc` when given (in `dtype`, the product's shape), for kernels
/// that multiply inside a larger op (the LoRA layer, the fused loss's
/// chunks, the linear layers' backward passes): on
/// cuBLASLt when the `matmul` patch is on and it takes the problem (the
/// factor and the sum in its epilogue, the sum into `acc`'s own memory when
/// nothing else holds it), else CubeCL's matmul and element-wise ops.
pub(crate) fn product<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    lhs: &CubeTensor<R>,
    rhs: &CubeTensor<R>,
    scale: f32,
    dtype: DType,
    acc: Option<CubeTensor<R>>,
) -> CubeTensor<R> {
    type Inner<R, F, I, BT> = CubeBackend<R, F, I, BT>;
    let blas = crate::patches::is_enabled(crate::patches::Op::Matmul)
        .then(|| cuda::product(lhs, rhs, scale, dtype, acc.as_ref()))
        .flatten();
    let out = match blas {
        Some((sum, true)) => return sum,
        Some((out, false)) => out,
        None => {
            // CubeCL's matmul writes the operands' dtype or f32.
            let written = if dtype == DType::F32 {
                dtype
            } else {
                lhs.dtype
            };
            let shape = burn_std::calculate_matmul_output(&lhs.shape(), &rhs.shape())
                .expect("a product's callers pass operands that multiply");
            let out = burn_cubecl::kernel::matmul::matmul(
                lhs.clone(),
                rhs.clone(),
                None,
                burn_cubecl::kernel::matmul::MatmulStrategy::default(),
                written,
            )
            .unwrap_or_else(|e| {
                crate::launch_failure::failed("matmul", format!("{e:?}"));
                crate::fused::cube::empty_like(lhs, shape, written)
            });
            let out = if scale == 1.0 {
                out
            } else {
                Inner::<R, F, I, BT>::float_mul_scalar(out, f64::from(scale).into())
            };
            crate::ops::cast_to::<Inner<R, F, I, BT>>(out, dtype)
        }
    };
    match acc {
        Some(acc) => Inner::<R, F, I, BT>::float_add(acc, out),
        None => out,
    }
}

/// `lhs · rhs` written in `dtype` and the column sums of each matrix of
/// `rhs` from the same cuBLASLt product (its epilogue), when the `matmul`
/// patch is on and cuBLASLt takes it; `None` otherwise (the caller then
/// multiplies and sums its own way). In `dW = xᵀ · dy` the sums are the
/// layer's bias gradient, read with `dy` instead of again after it.
pub(crate) fn product_and_column_sums<R: CubeRuntime>(
    lhs: &CubeTensor<R>,
    rhs: &CubeTensor<R>,
    dtype: DType,
) -> Option<(CubeTensor<R>, CubeTensor<R>)> {
    if !crate::patches::is_enabled(crate::patches::Op::Matmul) {
        return None;
    }
    cuda::product_and_column_sums(lhs, rhs, dtype)
}

/// `lhs · rhs (+ bias over the last dimension)`: `bias` is `[n]` for
/// every matrix, or `[batch.., n]` with the output's batch dimensions, one
/// vector per matrix (a batch of linear layers).
pub(crate) fn matmul<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
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
                    let shape = bias_rows_shape(&bias.shape(), out.shape().num_dims());
                    let bias = Inner::<R, F, I, BT>::float_reshape(bias, shape);
                    Inner::<R, F, I, BT>::float_add(out, bias)
                }
                None => out,
            }
        }
    }
}

/// A bias `[batch.., n]` viewed as `[1.., batch.., 1, n]`, of rank `rank`:
/// broadcast over each matrix's rows and any batch dimensions it lacks.
fn bias_rows_shape(bias: &Shape, rank: usize) -> Shape {
    let dims = bias.as_slice();
    let (n, batch) = dims.split_last().expect("a bias has a dimension");
    let ones = rank - 1 - dims.len();
    let shape: Vec<usize> = core::iter::repeat_n(1, ones)
        .chain(batch.iter().copied())
        .chain([1, *n])
        .collect();
    Shape::from(shape)
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
    use cubecl::server::Handle;

    use bastile_cubecl::cublaslt::{self, GemmBuffers, GemmDtypes};
    use bastile_cubecl::gemm_layout::{GemmPlan, PlanError, plan_matmul};
    use bastile_cubecl::{FloatDtype, KernelError};

    use crate::fused::kernel_dtype;

    pub fn device_index<R: CubeRuntime>(device: &R::Device) -> Option<usize> {
        (device as &dyn Any)
            .downcast_ref::<CudaDevice>()
            .map(|d| d.index)
    }

    /// The CUDA client behind `client` and the ordinal of `device`, `None`
    /// on any other runtime.
    pub fn cuda_client<'a, R: CubeRuntime>(
        client: &'a ComputeClient<R>,
        device: &R::Device,
    ) -> Option<(&'a ComputeClient<CudaRuntime>, usize)> {
        let index = device_index::<R>(device)?;
        let client = (client as &dyn Any).downcast_ref::<ComputeClient<CudaRuntime>>()?;
        Some((client, index))
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

    /// What a product's epilogue does besides writing it: its factor, a
    /// bias per output column (the same for every matrix of the batch, or
    /// `bias_batch_stride` elements apart), or a sum into the output's
    /// values.
    struct Epilogue<'a, R: CubeRuntime> {
        scale: f32,
        bias: Option<&'a CubeTensor<R>>,
        bias_batch_stride: usize,
        /// `bias` receives the column sums of each matrix of `rhs`.
        bias_grad: bool,
        accumulate: bool,
    }

    impl<'a, R: CubeRuntime> Epilogue<'a, R> {
        fn plain(bias: Option<&'a CubeTensor<R>>, bias_batch_stride: usize) -> Self {
            Self {
                scale: 1.0,
                bias,
                bias_batch_stride,
                bias_grad: false,
                accumulate: false,
            }
        }
    }

    /// The operands of one product as cuBLASLt can read them, with their
    /// plan, dtype and CUDA client.
    struct Operands<'a, R: CubeRuntime> {
        index: usize,
        client: &'a ComputeClient<CudaRuntime>,
        lhs: CubeTensor<R>,
        rhs: CubeTensor<R>,
        dtype: FloatDtype,
        plan: GemmPlan,
    }

    impl<'a, R: CubeRuntime> Operands<'a, R> {
        /// `None` when this is not the CUDA runtime, the dtypes differ or
        /// are not kernel dtypes, or the shapes do not match (the inner
        /// backend then reports them its usual way).
        fn new(lhs: &'a CubeTensor<R>, rhs: &CubeTensor<R>) -> Option<Self> {
            let (client, index) = cuda_client::<R>(&lhs.client, &lhs.device)?;
            let dtype = kernel_dtype(lhs.dtype)?;
            if rhs.dtype != lhs.dtype {
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
                Err(PlanError::Shape(_)) => return None,
            };
            Some(Self {
                index,
                client,
                lhs,
                rhs,
                dtype,
                plan,
            })
        }

        /// A new contiguous tensor of `shape` and `dtype` on the operands'
        /// device.
        fn empty(&self, shape: Vec<usize>, dtype: burn::tensor::DType) -> CubeTensor<R> {
            empty_device_contiguous_dtype(
                self.lhs.client.clone(),
                self.lhs.device.clone(),
                shape.into(),
                dtype,
            )
        }

        /// Writes `scale ·` the product (`+ bias`) into `out`, or adds it
        /// to `out` with `accumulate`; `false` when cuBLASLt declines it
        /// (nothing was written). A cuBLASLt error is a
        /// [launch failure](crate::launch_failure).
        fn run(&self, out: &Handle, out_dtype: FloatDtype, epilogue: Epilogue<'_, R>) -> bool {
            let dtypes = GemmDtypes {
                operands: self.dtype,
                out: out_dtype,
            };
            let buffers = GemmBuffers {
                lhs: &self.lhs.handle,
                rhs: &self.rhs.handle,
                bias: epilogue.bias.map(|b| &b.handle),
                bias_batch_stride: epilogue.bias_batch_stride,
                bias_grad: epilogue.bias_grad,
                out,
                scale: epilogue.scale,
                accumulate: epilogue.accumulate,
            };
            let on_error = |e| crate::launch_failure::failed("cuBLASLt matmul", e);
            match cublaslt::gemm(
                self.client,
                self.index,
                dtypes,
                &self.plan,
                buffers,
                on_error,
            ) {
                Ok(()) => true,
                Err(KernelError::Unsupported(_)) => false,
                Err(e) => {
                    crate::launch_failure::failed("cuBLASLt matmul", e);
                    true
                }
            }
        }
    }

    /// `None` when this is not the CUDA runtime or cuBLASLt declines the
    /// problem; the caller then takes the inner backend's matmul.
    pub fn matmul<R: CubeRuntime>(
        lhs: &CubeTensor<R>,
        rhs: &CubeTensor<R>,
        bias: Option<&CubeTensor<R>>,
        out_dtype: burn::tensor::DType,
    ) -> Option<CubeTensor<R>> {
        if bias.is_some_and(|b| b.dtype != lhs.dtype) {
            return None;
        }
        let out_kernel_dtype = kernel_dtype(out_dtype)?;
        let ops = Operands::new(lhs, rhs)?;
        // One vector for all matrices, or one per matrix of the plan's
        // single strided batch; anything else takes the fallback. (BLAS's
        // `m` is the output's columns: the call writes its transpose.)
        let columns = ops.plan.m;
        let bias_batch_stride = match bias.map(|b| b.shape().num_elements()) {
            None => 0,
            Some(len) if len == columns => 0,
            Some(len) if ops.plan.calls.len() == 1 && len == ops.plan.batch * columns => columns,
            Some(_) => return None,
        };
        let bias = bias.map(|b| into_contiguous(b.clone()));
        let out = ops.empty(ops.plan.out_shape.clone(), out_dtype);
        ops.run(
            &out.handle,
            out_kernel_dtype,
            Epilogue::plain(bias.as_ref(), bias_batch_stride),
        )
        .then_some(out)
    }

    /// `scale · lhs · rhs` in `out_dtype` (the operands' or f32), added
    /// into `acc` in place when `acc` can take it (nothing else holds it,
    /// contiguous, the product's shape and `out_dtype`): the result and
    /// whether it went into `acc`. `None` when this is not the CUDA
    /// runtime or cuBLASLt declines.
    pub fn product<R: CubeRuntime>(
        lhs: &CubeTensor<R>,
        rhs: &CubeTensor<R>,
        scale: f32,
        out_dtype: burn::tensor::DType,
        acc: Option<&CubeTensor<R>>,
    ) -> Option<(CubeTensor<R>, bool)> {
        let out_kernel_dtype = kernel_dtype(out_dtype)?;
        let ops = Operands::new(lhs, rhs)?;
        let epilogue = |accumulate| Epilogue {
            scale,
            bias: None,
            bias_batch_stride: 0,
            bias_grad: false,
            accumulate,
        };
        let takes_sum = |acc: &&CubeTensor<R>| {
            acc.dtype == out_dtype
                && acc.can_mut()
                && acc.is_contiguous()
                && acc.shape().as_slice() == ops.plan.out_shape.as_slice()
        };
        if let Some(acc) = acc.filter(takes_sum) {
            return ops
                .run(&acc.handle, out_kernel_dtype, epilogue(true))
                .then(|| (acc.clone(), true));
        }
        let out = ops.empty(ops.plan.out_shape.clone(), out_dtype);
        ops.run(&out.handle, out_kernel_dtype, epilogue(false))
            .then_some((out, false))
    }

    /// `lhs · rhs` in the operands' dtype and, from the same product's
    /// epilogue, the column sums of each matrix of `rhs` (`[batch.., n]`):
    /// `None` when this is not the CUDA runtime, `out_dtype` is not the
    /// operands', the batch takes several calls or cuBLASLt declines.
    pub fn product_and_column_sums<R: CubeRuntime>(
        lhs: &CubeTensor<R>,
        rhs: &CubeTensor<R>,
        out_dtype: burn::tensor::DType,
    ) -> Option<(CubeTensor<R>, CubeTensor<R>)> {
        if out_dtype != lhs.dtype {
            return None;
        }
        let ops = Operands::new(lhs, rhs)?;
        if ops.plan.calls.len() != 1 {
            return None;
        }
        let mut sums_shape = ops.plan.out_shape.clone();
        sums_shape.remove(sums_shape.len() - 2);
        let out = ops.empty(ops.plan.out_shape.clone(), out_dtype);
        let sums = ops.empty(sums_shape, out_dtype);
        let epilogue = Epilogue {
            scale: 1.0,
            bias: Some(&sums),
            // BLAS's `m` is the output's columns: the call writes its
            // transpose.
            bias_batch_stride: if ops.plan.batch > 1 { ops.plan.m } else { 0 },
            bias_grad: true,
            accumulate: false,
        };
        ops.run(&out.handle, ops.dtype, epilogue)
            .then_some((out, sums))
    }

    /// `false` when this is not the CUDA runtime, `out` is not a
    /// contiguous matrix of the operands' dtype with the product's columns
    /// and room for its rows from `first_row`, or cuBLASLt declines.
    pub fn matmul_into_rows<R: CubeRuntime>(
        lhs: &CubeTensor<R>,
        rhs: &CubeTensor<R>,
        out: &CubeTensor<R>,
        first_row: usize,
    ) -> bool {
        let Some(ops) = Operands::new(lhs, rhs) else {
            return false;
        };
        let out_shape = out.shape();
        let fits = match (ops.plan.out_shape.as_slice(), out_shape.as_slice()) {
            (&[m, n], &[rows, columns]) => n == columns && first_row + m <= rows,
            _ => false,
        };
        if !fits || out.dtype != lhs.dtype || !out.is_contiguous() {
            return false;
        }
        let row_bytes = (out_shape[1] * out.dtype.size()) as u64;
        let rows_after = (out_shape[0] - first_row - ops.plan.out_shape[0]) as u64;
        let rows = out
            .handle
            .clone()
            .offset_start(first_row as u64 * row_bytes)
            .offset_end(rows_after * row_bytes);
        ops.run(&rows, ops.dtype, Epilogue::plain(None, 0))
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

    pub fn matmul_into_rows<R: CubeRuntime>(
        _lhs: &CubeTensor<R>,
        _rhs: &CubeTensor<R>,
        _out: &CubeTensor<R>,
        _first_row: usize,
    ) -> bool {
        false
    }

    pub fn product<R: CubeRuntime>(
        _lhs: &CubeTensor<R>,
        _rhs: &CubeTensor<R>,
        _scale: f32,
        _out_dtype: burn::tensor::DType,
        _acc: Option<&CubeTensor<R>>,
    ) -> Option<(CubeTensor<R>, bool)> {
        None
    }

    pub fn product_and_column_sums<R: CubeRuntime>(
        _lhs: &CubeTensor<R>,
        _rhs: &CubeTensor<R>,
        _out_dtype: burn::tensor::DType,
    ) -> Option<(CubeTensor<R>, CubeTensor<R>)> {
        None
    }
}
