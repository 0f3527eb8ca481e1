//! How a fused attention call runs: the kernel family and block shapes,
//! decided once per call from the settings below, the device's answer and
//! the problem, and handed to the launch.

use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use burn::tensor::Device;

use super::AttentionQuery;
use crate::fused::KernelBackend;
use crate::patches::{Op, is_enabled};

/// Score-matrix size (`batch · heads · seq_q · seq_k` elements) from which
/// `Bastile<B>` runs the tiled attention kernels; below it, the composite
/// path.
///
/// The tiled kernels are the portable shared-memory path (f32 FMA): on an
/// H100 they are slower than the composite's matrix products but keep
/// memory linear in the sequence (475 MiB against 25.8 GB for one
/// Qwen3-sized layer at 8192 tokens). The default, 2²⁷ elements (512 MiB
/// of f32 scores per call, e.g. 16 heads at 4096 tokens), takes them where
/// the composite's saved scores start to decide whether a model fits. The
/// matrix-product path (see [`AttentionKernels`]) is faster than the
/// composite at every size measured and runs whatever the size, and so do
/// the tensor-core kernels.
pub const DEFAULT_FUSED_FROM: u64 = 1 << 27;

static FUSED_FROM: AtomicU64 = AtomicU64::new(DEFAULT_FUSED_FROM);

/// Sets the score-matrix size from which the tiled attention kernels run
/// (0: always, `u64::MAX`: never; see [`DEFAULT_FUSED_FROM`]).
pub fn set_fused_from(score_elements: u64) {
    FUSED_FROM.store(score_elements, Ordering::SeqCst);
}

/// Which kernels the fused attention runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionKernels {
    /// cuDNN's fused attention where it is loaded and takes the problem
    /// (CUDA, f16 and bf16, no sliding window, sinks, key lengths or
    /// documents: what PyTorch's default attention runs, warpgroup kernels
    /// on Hopper); else Bastile's tensor-core kernels where the runtime has
    /// them (CUDA, f16 and bf16, head dims that are multiples of 16); else
    /// matrix products where the `matmul` patch runs them on cuBLASLt;
    /// else the tiled kernels.
    #[default]
    Auto,
    /// Bastile's own tensor-core kernels where the runtime has them, never
    /// cuDNN's; else as [`AttentionKernels::Auto`].
    TensorCores,
    /// The tiled flash-style kernels (shared-memory tiles, f32 FMA) on
    /// every runtime.
    Tiled,
    /// Blocks of query rows through matrix products and row kernels on
    /// every runtime (the runtime's own matmul where cuBLASLt is absent),
    /// at most `block_rows` query rows per block; 0 sizes the blocks from
    /// [`BLOCK_SCORES`].
    MatrixProducts { block_rows: usize },
}

/// Score elements (`batch · heads · rows · keys`) one block of the
/// matrix-product path may hold: 2²⁶, i.e. 256 MiB of f32 scores, plus the
/// same again for their gradient and two half-size matrices in the
/// backward. Constant in the sequence length, so memory stays linear in it.
pub const BLOCK_SCORES: usize = 1 << 26;

/// 0: auto, 1: tiled, 2: tensor cores, n ≥ 3: matrix products with
/// `n − 3` block rows.
static KERNELS: AtomicU64 = AtomicU64::new(0);

/// Chooses the attention kernels (see [`AttentionKernels`]); process-wide,
/// read at every call.
pub fn set_attention_kernels(kernels: AttentionKernels) {
    let code = match kernels {
        AttentionKernels::Auto => 0,
        AttentionKernels::Tiled => 1,
        AttentionKernels::TensorCores => 2,
        AttentionKernels::MatrixProducts { block_rows } => 3 + block_rows as u64,
    };
    KERNELS.store(code, Ordering::SeqCst);
}

/// The attention kernels in use (see [`set_attention_kernels`]).
pub fn attention_kernels() -> AttentionKernels {
    match KERNELS.load(Ordering::SeqCst) {
        0 => AttentionKernels::Auto,
        1 => AttentionKernels::Tiled,
        2 => AttentionKernels::TensorCores,
        n => AttentionKernels::MatrixProducts {
            block_rows: (n - 3) as usize,
        },
    }
}

static DETERMINISTIC: AtomicBool = AtomicBool::new(false);

/// Makes the attention's backward pass bit-identical from run to run
/// (process-wide, read at every call): Bastile's own kernels with every
/// gradient written by the cube that owns it (on the tensor cores the
/// dK/dV kernel followed by the dQ kernel, without the fused kernel's
/// atomic additions into dQ), never cuDNN's. Off by default: the fused
/// and cuDNN backwards add into dQ in whatever order the GPU runs them,
/// which moves its last bits.
pub fn set_deterministic_attention(on: bool) {
    DETERMINISTIC.store(on, Ordering::SeqCst);
}

/// Whether the attention's backward is deterministic (see
/// [`set_deterministic_attention`]).
pub fn deterministic_attention() -> bool {
    DETERMINISTIC.load(Ordering::SeqCst)
}

/// Query rows per block of the matrix-product path for `batch · heads`
/// score matrices of `seq_k` keys: as many as [`BLOCK_SCORES`] allows, a
/// multiple of 64 (at least 16).
fn block_rows(matrices: usize, seq_k: usize) -> usize {
    let rows = BLOCK_SCORES / (matrices * seq_k).max(1);
    if rows >= 64 {
        rows / 64 * 64
    } else {
        rows.max(16)
    }
}

/// How a fused attention call runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionPlan {
    /// The tensor-core kernels (the tiled kernels for a problem or layout
    /// they refuse), after cuDNN's fused attention with `cudnn`; with
    /// `deterministic`, a backward without atomic additions.
    TensorCores { cudnn: bool, deterministic: bool },
    /// Blocks of at most `block_rows` query rows through matrix products.
    MatrixProducts { block_rows: usize },
    /// The tiled flash-style kernels.
    Tiled,
}

/// What a device's kernels can do for one attention problem.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionDevice {
    /// Some kernel family takes the problem.
    pub supported: bool,
    /// The runtime has tensor-core kernels for its dtype.
    pub tensor_cores: bool,
    /// cuDNN is loaded on the device and its graphs express the problem.
    pub cudnn: bool,
    /// The vendor BLAS takes its dtype (for the matrix-product path).
    pub blas: bool,
}

/// The plan for `query` on `K`'s `device`, or `None` for the composite
/// path: the tensor cores or matrix products whatever the size, the tiled
/// kernels from the size set by [`set_fused_from`].
pub(super) fn plan<K: KernelBackend>(
    device: &Device<K>,
    query: &AttentionQuery,
) -> Option<AttentionPlan> {
    let answer = K::ask(device, query)?;
    if !answer.supported {
        return None;
    }
    let [q, k] = &query.dims;
    let matrices = q[0] * q[1];
    let products = |rows| AttentionPlan::MatrixProducts {
        block_rows: if rows > 0 {
            rows
        } else {
            block_rows(matrices, k[2])
        },
    };
    let kernels = attention_kernels();
    let deterministic = deterministic_attention();
    let plan = match kernels {
        AttentionKernels::Auto if answer.cudnn && !deterministic => AttentionPlan::TensorCores {
            cudnn: true,
            deterministic,
        },
        AttentionKernels::Auto | AttentionKernels::TensorCores if answer.tensor_cores => {
            AttentionPlan::TensorCores {
                cudnn: false,
                deterministic,
            }
        }
        AttentionKernels::Auto | AttentionKernels::TensorCores
            if is_enabled(Op::Matmul) && answer.blas =>
        {
            products(0)
        }
        AttentionKernels::Auto | AttentionKernels::TensorCores | AttentionKernels::Tiled => {
            AttentionPlan::Tiled
        }
        AttentionKernels::MatrixProducts { block_rows } => products(block_rows),
    };
    let scores = matrices as u64 * (q[2] * k[2]) as u64;
    (plan != AttentionPlan::Tiled || scores >= FUSED_FROM.load(Ordering::SeqCst)).then_some(plan)
}
