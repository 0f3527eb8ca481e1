//! How each inner backend runs Bastile's kernels: [`KernelBackend`].
//!
//! `CubeBackend` launches them directly (`cube.rs`), `Fusion<B>` records a
//! custom op in its stream that launches them on `B` when the stream runs
//! (`fusion.rs`), and backends without CubeCL (NdArray) report every op as
//! unsupported so `Bastile<B>` takes the composite path.

mod cube;
mod fusion;

use burn::backend::NdArray;
use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Device, Shape};

use crate::RmsNormCast;
use crate::ops::adamw::{AdamWStep, AdamWTensors};
use crate::ops::attention::{AttentionGrads, AttentionSpec};
use crate::ops::cross_entropy::LossSpec;
use crate::ops::linear_cross_entropy::LinearGrads;
use crate::ops::rope::RopeOptions;
use crate::ops::swiglu::GluTensors;

/// A backend that can run Bastile's fused kernels. The `*_kernel` methods
/// are only called when the matching `*_supported` predicate said yes.
pub trait KernelBackend: Backend {
    /// Whether the fused RMSNorm kernels take rows of `hidden` elements of
    /// `dtype` on `device`.
    fn rms_norm_supported(_device: &Device<Self>, _hidden: usize, _dtype: DType) -> bool {
        false
    }

    /// Fused forward: `(y, rstd)` with `rstd` f32 `[rows]`.
    fn rms_norm_forward_kernel(
        _x: FloatTensor<Self>,
        _gamma: FloatTensor<Self>,
        _eps: f64,
        _cast: RmsNormCast,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        unreachable!("rms_norm_forward_kernel called on a backend that does not support it")
    }

    /// Fused backward: `(dx, dgamma)`.
    fn rms_norm_backward_kernel(
        _x: FloatTensor<Self>,
        _gamma: FloatTensor<Self>,
        _rstd: FloatTensor<Self>,
        _dy: FloatTensor<Self>,
        _cast: RmsNormCast,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        unreachable!("rms_norm_backward_kernel called on a backend that does not support it")
    }

    /// Whether the element-wise kernels (SwiGLU, GEGLU, RoPE) take `dtype`
    /// on `device`.
    fn elementwise_supported(_device: &Device<Self>, _dtype: DType) -> bool {
        false
    }

    /// Fused SwiGLU forward.
    fn swiglu_forward_kernel(_input: GluTensors<FloatTensor<Self>>) -> FloatTensor<Self> {
        unreachable!("swiglu_forward_kernel called on a backend that does not support it")
    }

    /// Fused SwiGLU backward: gradients in the form of the input.
    fn swiglu_backward_kernel(
        _input: GluTensors<FloatTensor<Self>>,
        _dout: FloatTensor<Self>,
    ) -> GluTensors<FloatTensor<Self>> {
        unreachable!("swiglu_backward_kernel called on a backend that does not support it")
    }

    /// Fused GEGLU forward.
    fn geglu_forward_kernel(_x: FloatTensor<Self>, _alpha: f64, _limit: f64) -> FloatTensor<Self> {
        unreachable!("geglu_forward_kernel called on a backend that does not support it")
    }

    /// Fused GEGLU backward.
    fn geglu_backward_kernel(
        _x: FloatTensor<Self>,
        _dout: FloatTensor<Self>,
        _alpha: f64,
        _limit: f64,
    ) -> FloatTensor<Self> {
        unreachable!("geglu_backward_kernel called on a backend that does not support it")
    }

    /// Fused RoPE of q (and k) in one launch.
    fn rope_kernel(
        _q: FloatTensor<Self>,
        _k: Option<FloatTensor<Self>>,
        _cos: FloatTensor<Self>,
        _sin: FloatTensor<Self>,
        _options: RopeOptions,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        unreachable!("rope_kernel called on a backend that does not support it")
    }

    /// Whether [`Self::matmul_kernel`] runs on a vendor BLAS (cuBLASLt) for
    /// `dtype` on `device`.
    fn matmul_supported(_device: &Device<Self>, _dtype: DType) -> bool {
        false
    }

    /// `lhs · rhs` (Burn's `float_matmul` semantics: equal ranks, batch
    /// dimensions broadcast), plus `bias` `[N]` added to every row when
    /// given. Problems the BLAS declines take the backend's own matmul.
    fn matmul_kernel(
        _lhs: FloatTensor<Self>,
        _rhs: FloatTensor<Self>,
        _bias: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        unreachable!("matmul_kernel called on a backend that does not support it")
    }

    /// Whether the cross-entropy kernel takes logits of `dtype` on `device`.
    fn cross_entropy_supported(_device: &Device<Self>, _dtype: DType) -> bool {
        false
    }

    /// Per-token `(losses, lse)`, f32 `[N]` each, of `logits` `[N, V]`.
    fn cross_entropy_kernel(
        _logits: FloatTensor<Self>,
        _labels: IntTensor<Self>,
        _spec: LossSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        unreachable!("cross_entropy_kernel called on a backend that does not support it")
    }

    /// The logits gradient for the upstream f32 gradient `dloss` (`[1]`
    /// for every token, or `[N]`), from the forward's `lse`.
    fn cross_entropy_grad_kernel(
        _logits: FloatTensor<Self>,
        _labels: IntTensor<Self>,
        _lse: FloatTensor<Self>,
        _dloss: FloatTensor<Self>,
        _spec: LossSpec,
    ) -> FloatTensor<Self> {
        unreachable!("cross_entropy_grad_kernel called on a backend that does not support it")
    }

    /// Chunked linear cross-entropy: per-token `(losses, lse)` and, with
    /// `grads`, the gradients of the scaled loss sum.
    fn linear_cross_entropy_kernel(
        _hidden: FloatTensor<Self>,
        _weight: FloatTensor<Self>,
        _bias: Option<FloatTensor<Self>>,
        _labels: IntTensor<Self>,
        _spec: LossSpec,
        _grads: bool,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        Option<LinearGrads<FloatTensor<Self>>>,
    ) {
        unreachable!("linear_cross_entropy_kernel called on a backend that does not support it")
    }

    /// Chunked gradients for per-token upstream gradients `dloss` (f32 `[N]`).
    #[allow(clippy::too_many_arguments)]
    fn linear_cross_entropy_backward_kernel(
        _hidden: FloatTensor<Self>,
        _weight: FloatTensor<Self>,
        _bias: Option<FloatTensor<Self>>,
        _labels: IntTensor<Self>,
        _lse: FloatTensor<Self>,
        _dloss: FloatTensor<Self>,
        _spec: LossSpec,
    ) -> LinearGrads<FloatTensor<Self>> {
        unreachable!(
            "linear_cross_entropy_backward_kernel called on a backend that does not support it"
        )
    }

    /// Whether the attention kernels take query and key shapes `dims` of
    /// `dtype` with these options on `device`.
    fn attention_supported(
        _device: &Device<Self>,
        _dims: &[Shape; 2],
        _dtype: DType,
        _spec: &AttentionSpec,
    ) -> bool {
        false
    }

    /// Whether fused attention on `device` in `dtype` runs on a path
    /// faster than the composite at every size (the tensor cores or matrix
    /// products; see [`crate::AttentionKernels`]).
    fn attention_always_fused(_device: &Device<Self>, _dtype: DType) -> bool {
        false
    }

    /// Fused attention forward: `(out, lse)`, `lse` f32 `[batch, heads, seq_q]`.
    fn attention_forward_kernel(
        _q: FloatTensor<Self>,
        _k: FloatTensor<Self>,
        _v: FloatTensor<Self>,
        _sinks: Option<FloatTensor<Self>>,
        _key_lengths: Option<IntTensor<Self>>,
        _spec: AttentionSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        unreachable!("attention_forward_kernel called on a backend that does not support it")
    }

    /// Fused attention backward. The sink gradient comes per query row
    /// (f32 `[batch, heads, seq_q]`); the caller sums it per head.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward_kernel(
        _q: FloatTensor<Self>,
        _k: FloatTensor<Self>,
        _v: FloatTensor<Self>,
        _out: FloatTensor<Self>,
        _lse: FloatTensor<Self>,
        _dout: FloatTensor<Self>,
        _sinks: Option<FloatTensor<Self>>,
        _key_lengths: Option<IntTensor<Self>>,
        _spec: AttentionSpec,
    ) -> AttentionGrads<FloatTensor<Self>> {
        unreachable!("attention_backward_kernel called on a backend that does not support it")
    }

    /// The global gradient norm and clip factor, `[scale, norm]` (f32),
    /// for gradients whose dtypes `elementwise_supported` takes.
    fn adamw_clip_kernel(
        _grads: Vec<FloatTensor<Self>>,
        _max_norm: Option<f64>,
    ) -> FloatTensor<Self> {
        unreachable!("adamw_clip_kernel called on a backend that does not support it")
    }

    /// The fused AdamW step of every parameter, each with its gradient of
    /// `grads` (same order), in place where the buffers are not shared.
    fn adamw_update_kernel(
        _params: Vec<AdamWTensors<FloatTensor<Self>>>,
        _grads: Vec<FloatTensor<Self>>,
        _clip: Option<FloatTensor<Self>>,
        _hyper: AdamWStep,
    ) -> Vec<AdamWTensors<FloatTensor<Self>>> {
        unreachable!("adamw_update_kernel called on a backend that does not support it")
    }
}

impl KernelBackend for NdArray {}

/// The kernel dtype for a Burn dtype, if the kernels are built for it.
pub fn kernel_dtype(dtype: DType) -> Option<bastile_cubecl::FloatDtype> {
    match dtype {
        DType::F32 => Some(bastile_cubecl::FloatDtype::F32),
        DType::F16 => Some(bastile_cubecl::FloatDtype::F16),
        DType::BF16 => Some(bastile_cubecl::FloatDtype::BF16),
        _ => None,
    }
}
