//! cuBLASLt descriptors for one planned problem and the heuristic's
//! candidate algorithms for it, kept per device and key: building them
//! costs about a dozen library calls and the heuristic query tens of
//! microseconds, more than a small projection's whole product.

use core::ffi::c_void;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys::{
    self as lt_sys, cublasComputeType_t, cublasLtEpilogue_t, cublasLtHandle_t,
    cublasLtMatmulAlgo_t, cublasLtMatmulDesc_t, cublasLtMatmulDescAttributes_t as DescAttr,
    cublasLtMatmulHeuristicResult_t, cublasLtMatmulPreference_t,
    cublasLtMatmulPreferenceAttributes_t as PrefAttr, cublasLtMatrixLayout_t,
    cublasLtMatrixLayoutAttribute_t as LayoutAttr, cublasStatus_t, cudaDataType,
};

use super::device::WORKSPACE_BYTES;
use crate::FloatDtype;
use crate::KernelError;
use crate::gemm_layout::{BlasOperand, GemmPlan};

/// Everything the heuristic's choice depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AlgoKey {
    /// The operands' dtype.
    pub dtype: FloatDtype,
    /// The output's: the operands' or f32 (f32 sums of 16-bit products
    /// kept unrounded, e.g. for gradient accumulators).
    pub out_dtype: FloatDtype,
    pub tf32: bool,
    pub a: BlasOperand,
    pub b: BlasOperand,
    pub mnk: [usize; 3],
    pub ldd: usize,
    pub d_batch_stride: usize,
    pub batch: usize,
    pub bias: Option<Bias>,
    /// Pointer alignments in bytes of A, B, D (and the bias).
    pub align: [u32; 4],
}

/// The bias epilogue of a problem.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Bias {
    /// Elements between consecutive matrices' bias vectors (0: one vector
    /// for the whole batch).
    pub batch_stride: usize,
    /// Whether the epilogue writes the bias's gradient (BLAS's `A` summed
    /// over `k`: the column sums of the row-major right-hand operand)
    /// instead of adding the bias.
    pub grad: bool,
}

fn cuda_type(dtype: FloatDtype) -> cudaDataType {
    match dtype {
        FloatDtype::F32 => cudaDataType::CUDA_R_32F,
        FloatDtype::F16 => cudaDataType::CUDA_R_16F,
        FloatDtype::BF16 => cudaDataType::CUDA_R_16BF,
    }
}

/// The largest power of two (up to 256, cuBLASLt's default assumption)
/// dividing the address.
pub fn alignment(ptr: u64) -> u32 {
    if ptr == 0 {
        256
    } else {
        1u32 << ptr.trailing_zeros().min(8)
    }
}

fn lt_err(what: &'static str) -> impl Fn(lt::CublasError) -> KernelError {
    move |e| KernelError::Launch(format!("cuBLASLt {what}: {e:?}"))
}

/// How many algorithms the heuristic is asked for; [`super::tune`] times
/// them on the first call.
const CANDIDATES: usize = 8;

/// The descriptors of one problem, destroyed on drop.
pub struct Descriptors {
    pub desc: cublasLtMatmulDesc_t,
    pub a: cublasLtMatrixLayout_t,
    pub b: cublasLtMatrixLayout_t,
    pub d: cublasLtMatrixLayout_t,
    pref: cublasLtMatmulPreference_t,
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: each was created by `Descriptors::new` and is destroyed once.
        unsafe {
            let _ = lt::destroy_matmul_pref(self.pref);
            let _ = lt::destroy_matrix_layout(self.d);
            let _ = lt::destroy_matrix_layout(self.b);
            let _ = lt::destroy_matrix_layout(self.a);
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

/// Sets one attribute through a cuBLASLt `*SetAttribute` call (they all
/// take the object, the attribute and the value's bytes).
///
/// # Safety
/// `object` is live and `T` is the attribute's type.
unsafe fn set_attr<O, A, T>(
    setter: unsafe fn(O, A, *const c_void, usize) -> Result<(), lt::CublasError>,
    object: O,
    attr: A,
    value: &T,
    what: &'static str,
) -> Result<(), KernelError> {
    unsafe {
        setter(
            object,
            attr,
            value as *const T as *const c_void,
            size_of::<T>(),
        )
    }
    .map_err(lt_err(what))
}

unsafe fn set_desc<T>(
    desc: cublasLtMatmulDesc_t,
    attr: DescAttr,
    value: &T,
) -> Result<(), KernelError> {
    unsafe {
        set_attr(
            lt::set_matmul_desc_attribute,
            desc,
            attr,
            value,
            "matmul attribute",
        )
    }
}

unsafe fn set_layout<T>(
    layout: cublasLtMatrixLayout_t,
    attr: LayoutAttr,
    value: &T,
) -> Result<(), KernelError> {
    unsafe {
        set_attr(
            lt::set_matrix_layout_attribute,
            layout,
            attr,
            value,
            "layout attribute",
        )
    }
}

unsafe fn set_pref<T>(
    pref: cublasLtMatmulPreference_t,
    attr: PrefAttr,
    value: &T,
) -> Result<(), KernelError> {
    unsafe {
        set_attr(
            lt::set_matmul_pref_attribute,
            pref,
            attr,
            value,
            "preference",
        )
    }
}

fn layout(
    dtype: cudaDataType,
    op: &BlasOperand,
    batch: usize,
) -> Result<cublasLtMatrixLayout_t, KernelError> {
    let l = lt::create_matrix_layout(dtype, op.rows as u64, op.cols as u64, op.ld as i64)
        .map_err(lt_err("layout"))?;
    if batch > 1 {
        // SAFETY: `l` is a live layout.
        unsafe {
            set_layout(
                l,
                LayoutAttr::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                &(batch as i32),
            )?;
            set_layout(
                l,
                LayoutAttr::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                &(op.batch_stride as i64),
            )?;
        }
    }
    Ok(l)
}

impl Descriptors {
    /// Descriptors for `key`; with `key.bias` the bias epilogue (or its
    /// gradient's) is on and [`Self::set_bias`] gives each call its vector.
    pub fn new(key: &AlgoKey) -> Result<Self, KernelError> {
        let compute = match (key.dtype, key.tf32) {
            (FloatDtype::F32, true) => cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            _ => cublasComputeType_t::CUBLAS_COMPUTE_32F,
        };
        let desc = lt::create_matmul_desc(compute, cudaDataType::CUDA_R_32F)
            .map_err(lt_err("matmul desc"))?;
        let dtype = cuda_type(key.dtype);
        let [m, n, _] = key.mnk;
        let d_op = BlasOperand {
            transposed: false,
            rows: m,
            cols: n,
            ld: key.ldd,
            batch_stride: key.d_batch_stride,
        };
        // Built one by one so an error still destroys what exists.
        let mut this = Self {
            desc,
            a: core::ptr::null_mut(),
            b: core::ptr::null_mut(),
            d: core::ptr::null_mut(),
            pref: core::ptr::null_mut(),
        };
        this.a = layout(dtype, &key.a, key.batch)?;
        this.b = layout(dtype, &key.b, key.batch)?;
        this.d = layout(cuda_type(key.out_dtype), &d_op, key.batch)?;
        this.pref = lt::create_matmul_pref().map_err(lt_err("preference"))?;
        let op = |t: bool| if t { 1i32 } else { 0i32 }; // CUBLAS_OP_T / CUBLAS_OP_N
        // SAFETY: every descriptor is live; values have the attribute's type.
        unsafe {
            set_desc(
                desc,
                DescAttr::CUBLASLT_MATMUL_DESC_TRANSA,
                &op(key.a.transposed),
            )?;
            set_desc(
                desc,
                DescAttr::CUBLASLT_MATMUL_DESC_TRANSB,
                &op(key.b.transposed),
            )?;
            if let Some(bias) = key.bias {
                let epilogue = if bias.grad {
                    cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BGRADA
                } else {
                    cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS
                };
                set_desc(desc, DescAttr::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue)?;
                if bias.batch_stride > 0 {
                    set_desc(
                        desc,
                        DescAttr::CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE,
                        &(bias.batch_stride as i64),
                    )?;
                }
            }
            set_pref(
                this.pref,
                PrefAttr::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &(WORKSPACE_BYTES as u64),
            )?;
            let [a, b, d, _] = key.align;
            set_pref(
                this.pref,
                PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                &a,
            )?;
            set_pref(
                this.pref,
                PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                &b,
            )?;
            set_pref(
                this.pref,
                PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                &d,
            )?;
            set_pref(
                this.pref,
                PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                &d,
            )?;
        }
        Ok(this)
    }

    /// Points the bias epilogue at `ptr` for the next call (cuBLASLt reads
    /// the descriptor when the call is enqueued, so a kept descriptor can
    /// serve calls with different bias vectors).
    pub fn set_bias(&self, ptr: u64) -> Result<(), KernelError> {
        // SAFETY: `desc` is live; the attribute is a device pointer.
        unsafe { set_desc(self.desc, DescAttr::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &ptr) }
    }

    /// The heuristic's algorithms for these descriptors, best first; empty
    /// when cuBLASLt has none.
    pub fn candidates(&self, handle: cublasLtHandle_t) -> Vec<cublasLtMatmulAlgo_t> {
        // SAFETY: a plain C struct for which all-zero bytes are valid.
        let blank: cublasLtMatmulHeuristicResult_t = unsafe { core::mem::zeroed() };
        let mut results = [blank; CANDIDATES];
        let mut count = 0;
        // SAFETY: all descriptors are live; `results` has room for the
        // requested count.
        let status = unsafe {
            lt_sys::cublasLtMatmulAlgoGetHeuristic(
                handle,
                self.desc,
                self.a,
                self.b,
                self.d,
                self.d,
                self.pref,
                CANDIDATES as i32,
                results.as_mut_ptr(),
                &mut count,
            )
        };
        if status != cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Vec::new();
        }
        results[..count.clamp(0, CANDIDATES as i32) as usize]
            .iter()
            .filter(|r| r.state == cublasStatus_t::CUBLAS_STATUS_SUCCESS)
            .map(|r| r.algo)
            .collect()
    }
}

/// What a device keeps per problem: the descriptors, the heuristic's
/// candidates and, after the first call timed them, the fastest.
pub struct Prepared {
    pub desc: Descriptors,
    pub candidates: Vec<cublasLtMatmulAlgo_t>,
    pub chosen: Option<cublasLtMatmulAlgo_t>,
}

impl Prepared {
    /// `None` when cuBLASLt has no algorithm for `key`.
    pub fn new(key: &AlgoKey, handle: cublasLtHandle_t) -> Result<Option<Self>, KernelError> {
        let desc = Descriptors::new(key)?;
        let candidates = desc.candidates(handle);
        Ok((!candidates.is_empty()).then_some(Self {
            desc,
            candidates,
            chosen: None,
        }))
    }
}

/// The key of one planned call.
pub fn key(
    plan: &GemmPlan,
    [dtype, out_dtype]: [FloatDtype; 2],
    tf32: bool,
    bias: Option<Bias>,
    align: [u32; 4],
) -> AlgoKey {
    AlgoKey {
        dtype,
        out_dtype,
        tf32: tf32 && dtype == FloatDtype::F32,
        a: plan.a,
        b: plan.b,
        mnk: [plan.m, plan.n, plan.k],
        ldd: plan.ldd,
        d_batch_stride: plan.d_batch_stride,
        batch: plan.batch,
        bias,
        align,
    }
}
