//! The fused ops: [`BastileBackend`] and its implementations.
//!
//! * Every method has a composite default written with plain Burn ops: the
//!   reference semantics, and what every backend gets for free.
//! * `Bastile<B>` overrides the `*_fused` predicates and the forward /
//!   backward methods with kernels, through [`KernelBackend`].
//! * `Autodiff<B>` builds one autodiff node per fused op whose backward is
//!   `B`'s backward method (see each op's file), and takes the composite
//!   path when `B` has no fused kernel for the input.

pub mod adamw;
pub mod attention;
pub mod cross_entropy;
pub mod geglu;
pub mod linear_cross_entropy;
pub mod rms_norm;
pub mod rope;
pub mod swiglu;

use burn::backend::NdArray;
use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Device, Shape, Tensor, TensorMetadata, TensorPrimitive};
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use crate::{Bastile, BastileError, RmsNormCast, patches};
use adamw::{AdamWStep, AdamWTensors};
use attention::{AttentionGrads, AttentionSpec};
use cross_entropy::{LossPair, LossSpec};
use linear_cross_entropy::LinearGrads;
use rope::RopeOptions;
use swiglu::GluTensors;

pub use crate::kernels::KernelBackend;

/// The fused ops of Bastile, on primitives. The public, checked entry points
/// are the functions of each op module (e.g. [`rms_norm::rms_norm`]) and the
/// [`crate::nn`] modules; these methods assume validated inputs.
pub trait BastileBackend: Backend {
    /// Whether [`BastileBackend::rms_norm_forward`] runs a fused kernel for
    /// this input (as opposed to the composite reference).
    fn rms_norm_fused(_device: &Device<Self>, _hidden: usize, _dtype: DType) -> bool {
        false
    }

    /// RMSNorm over the last dimension of `x`, scaled by `gamma`.
    fn rms_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        eps: f64,
        cast: RmsNormCast,
    ) -> FloatTensor<Self> {
        Self::rms_norm_forward(x, gamma, eps, cast).0
    }

    /// RMSNorm forward that also returns the per-row `rstd` (f32, one value
    /// per row) that [`BastileBackend::rms_norm_backward`] takes.
    fn rms_norm_forward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        eps: f64,
        cast: RmsNormCast,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        rms_norm::composite_forward::<Self>(x, gamma, eps, cast)
    }

    /// RMSNorm backward: `(dx, dgamma)` from the forward's inputs, its saved
    /// `rstd` and the output gradient `dy`.
    fn rms_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        cast: RmsNormCast,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        rms_norm::composite_backward::<Self>(x, gamma, rstd, dy, cast)
    }

    /// Whether [`BastileBackend::swiglu`] runs a fused kernel for `dtype`.
    fn swiglu_fused(_device: &Device<Self>, _dtype: DType) -> bool {
        false
    }

    /// `silu(gate) · up`.
    fn swiglu(input: GluTensors<FloatTensor<Self>>) -> FloatTensor<Self> {
        swiglu::composite_forward::<Self>(input)
    }

    /// SwiGLU backward: d_gate and d_up, in the form of the input.
    fn swiglu_backward(
        input: GluTensors<FloatTensor<Self>>,
        dout: FloatTensor<Self>,
    ) -> GluTensors<FloatTensor<Self>> {
        swiglu::composite_backward::<Self>(input, dout)
    }

    /// Whether [`BastileBackend::geglu_oss`] runs a fused kernel for `dtype`.
    fn geglu_oss_fused(_device: &Device<Self>, _dtype: DType) -> bool {
        false
    }

    /// GPT-OSS's clamped GEGLU over interleaved `gate_up`.
    fn geglu_oss(x: FloatTensor<Self>, alpha: f64, limit: f64) -> FloatTensor<Self> {
        geglu::composite_forward::<Self>(x, alpha, limit)
    }

    /// GEGLU backward: the interleaved input gradient.
    fn geglu_oss_backward(
        x: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        alpha: f64,
        limit: f64,
    ) -> FloatTensor<Self> {
        geglu::composite_backward::<Self>(x, dout, alpha, limit)
    }

    /// Whether [`BastileBackend::rope`] runs a fused kernel for `dtype`.
    fn rope_fused(_device: &Device<Self>, _dtype: DType) -> bool {
        false
    }

    /// Rotates q (and k) by the table angles; `cos`/`sin` are f32
    /// `[tables, positions, head_dim/2]`.
    fn rope(
        q: FloatTensor<Self>,
        k: Option<FloatTensor<Self>>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        options: RopeOptions,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        rope::composite::<Self>(q, k, cos, sin, options)
    }

    /// Whether [`BastileBackend::cross_entropy`] runs a fused kernel for
    /// logits of `dtype`.
    fn cross_entropy_fused(_device: &Device<Self>, _dtype: DType) -> bool {
        false
    }

    /// Cross-entropy of `logits` `[N, V]`: `(loss, lse)`, both f32, the
    /// loss reduced as `spec` says and `lse` per token.
    fn cross_entropy(
        logits: FloatTensor<Self>,
        labels: IntTensor<Self>,
        spec: LossSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        cross_entropy::composite::<Self>(logits, labels, spec)
    }

    /// The logits gradient of [`BastileBackend::cross_entropy`] for the
    /// upstream gradient `dloss` of its loss.
    fn cross_entropy_backward(
        logits: FloatTensor<Self>,
        labels: IntTensor<Self>,
        lse: FloatTensor<Self>,
        dloss: FloatTensor<Self>,
        spec: LossSpec,
    ) -> FloatTensor<Self> {
        cross_entropy::composite_backward::<Self>(logits, labels, lse, dloss, spec)
    }

    /// Whether [`BastileBackend::linear_cross_entropy`] runs fused
    /// (chunked, no materialized logits) for inputs of `dtype`.
    fn linear_cross_entropy_fused(_device: &Device<Self>, _dtype: DType) -> bool {
        false
    }

    /// Cross-entropy of `hidden · weightᵀ (+ bias)`: `(loss, lse)`.
    fn linear_cross_entropy(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        labels: IntTensor<Self>,
        spec: LossSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        linear_cross_entropy::composite::<Self>(hidden, weight, bias, labels, spec)
    }

    /// [`BastileBackend::linear_cross_entropy`] that also returns the
    /// gradients of the loss (for an upstream gradient of 1).
    fn linear_cross_entropy_with_grads(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        labels: IntTensor<Self>,
        spec: LossSpec,
    ) -> (LossPair<FloatTensor<Self>>, LinearGrads<FloatTensor<Self>>) {
        linear_cross_entropy::composite_with_grads::<Self>(hidden, weight, bias, labels, spec)
    }

    /// The gradients for the upstream gradient `dloss` (f32, `[1]` or
    /// `[N]`), recomputed from the inputs and the forward's `lse`.
    fn linear_cross_entropy_backward(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        labels: IntTensor<Self>,
        lse: FloatTensor<Self>,
        dloss: FloatTensor<Self>,
        spec: LossSpec,
    ) -> LinearGrads<FloatTensor<Self>> {
        linear_cross_entropy::composite_backward::<Self>(
            hidden, weight, bias, labels, lse, dloss, spec,
        )
    }

    /// Whether [`BastileBackend::flash_attention`] runs fused kernels for query
    /// and key shapes `dims` (`[batch, heads, seq, head_dim]`) of `dtype`.
    fn attention_fused(
        _device: &Device<Self>,
        _dims: &[Shape; 2],
        _dtype: DType,
        _spec: &AttentionSpec,
    ) -> bool {
        false
    }

    /// Attention (see [`attention::attention`] for the semantics).
    fn flash_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        sinks: Option<FloatTensor<Self>>,
        key_lengths: Option<IntTensor<Self>>,
        spec: AttentionSpec,
    ) -> FloatTensor<Self> {
        Self::attention_forward(q, k, v, sinks, key_lengths, spec).0
    }

    /// Attention that also returns the f32 log-sum-exp per query row
    /// (`[batch, heads, seq_q]`) that [`BastileBackend::attention_backward`]
    /// takes.
    fn attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        sinks: Option<FloatTensor<Self>>,
        key_lengths: Option<IntTensor<Self>>,
        spec: AttentionSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        attention::composite_forward::<Self>(q, k, v, sinks, key_lengths, spec)
    }

    /// Attention backward from the forward's inputs, output and
    /// log-sum-exp, and the output gradient `dout`.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        _lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        sinks: Option<FloatTensor<Self>>,
        key_lengths: Option<IntTensor<Self>>,
        spec: AttentionSpec,
    ) -> AttentionGrads<FloatTensor<Self>> {
        attention::composite_backward::<Self>(q, k, v, out, dout, sinks, key_lengths, spec)
    }

    /// `[scale, norm]` (f32 `[2]`): the global L2 norm of `grads` (at least
    /// one) and the factor that clips it to `max_norm` (1 without a bound).
    fn adamw_clip(grads: Vec<FloatTensor<Self>>, max_norm: Option<f64>) -> FloatTensor<Self> {
        adamw::composite_clip::<Self>(grads, max_norm)
    }

    /// The AdamW step of every parameter (see [`AdamWTensors`] for the
    /// shapes), each with its gradient of `grads` (same order, the
    /// parameter's shape) scaled by `clip[0]`; the whole step is skipped
    /// when the norm `clip[1]` is not finite. Each parameter comes back in
    /// its shape, its state flat.
    fn adamw_update(
        params: Vec<AdamWTensors<FloatTensor<Self>>>,
        grads: Vec<FloatTensor<Self>>,
        clip: Option<FloatTensor<Self>>,
        hyper: AdamWStep,
    ) -> Vec<AdamWTensors<FloatTensor<Self>>> {
        adamw::composite_update_all::<Self>(params, grads, clip, hyper)
    }
}

// The plain backends Bastile is compared against: composite everywhere.
impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> BastileBackend
    for CubeBackend<R, F, I, BT>
{
}
impl<B: burn_fusion::FusionBackend> BastileBackend for burn_fusion::Fusion<B> {}
impl BastileBackend for NdArray {}

impl<B: KernelBackend> BastileBackend for Bastile<B> {
    fn rms_norm_fused(device: &Device<Self>, hidden: usize, dtype: DType) -> bool {
        patches::is_enabled(patches::Op::RmsNorm) && B::rms_norm_supported(device, hidden, dtype)
    }

    fn rms_norm_forward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        eps: f64,
        cast: RmsNormCast,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let device = B::float_device(&x);
        let hidden = rms_norm::hidden_of::<B>(&x);
        if Self::rms_norm_fused(&device, hidden, burn::tensor::TensorMetadata::dtype(&x)) {
            B::rms_norm_forward_kernel(x, gamma, eps, cast)
        } else {
            rms_norm::composite_forward::<B>(x, gamma, eps, cast)
        }
    }

    fn rms_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        cast: RmsNormCast,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let device = B::float_device(&x);
        let hidden = rms_norm::hidden_of::<B>(&x);
        if Self::rms_norm_fused(&device, hidden, burn::tensor::TensorMetadata::dtype(&x)) {
            B::rms_norm_backward_kernel(x, gamma, rstd, dy, cast)
        } else {
            rms_norm::composite_backward::<B>(x, gamma, rstd, dy, cast)
        }
    }

    fn swiglu_fused(device: &Device<Self>, dtype: DType) -> bool {
        patches::is_enabled(patches::Op::SwiGlu) && B::elementwise_supported(device, dtype)
    }

    fn swiglu(input: GluTensors<FloatTensor<Self>>) -> FloatTensor<Self> {
        let first = input.first();
        if Self::swiglu_fused(&B::float_device(first), first.dtype()) {
            B::swiglu_forward_kernel(input)
        } else {
            swiglu::composite_forward::<B>(input)
        }
    }

    fn swiglu_backward(
        input: GluTensors<FloatTensor<Self>>,
        dout: FloatTensor<Self>,
    ) -> GluTensors<FloatTensor<Self>> {
        let first = input.first();
        if Self::swiglu_fused(&B::float_device(first), first.dtype()) {
            B::swiglu_backward_kernel(input, dout)
        } else {
            swiglu::composite_backward::<B>(input, dout)
        }
    }

    fn geglu_oss_fused(device: &Device<Self>, dtype: DType) -> bool {
        patches::is_enabled(patches::Op::Geglu) && B::elementwise_supported(device, dtype)
    }

    fn geglu_oss(x: FloatTensor<Self>, alpha: f64, limit: f64) -> FloatTensor<Self> {
        if Self::geglu_oss_fused(&B::float_device(&x), x.dtype()) {
            B::geglu_forward_kernel(x, alpha, limit)
        } else {
            geglu::composite_forward::<B>(x, alpha, limit)
        }
    }

    fn geglu_oss_backward(
        x: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        alpha: f64,
        limit: f64,
    ) -> FloatTensor<Self> {
        if Self::geglu_oss_fused(&B::float_device(&x), x.dtype()) {
            B::geglu_backward_kernel(x, dout, alpha, limit)
        } else {
            geglu::composite_backward::<B>(x, dout, alpha, limit)
        }
    }

    fn rope_fused(device: &Device<Self>, dtype: DType) -> bool {
        patches::is_enabled(patches::Op::Rope) && B::elementwise_supported(device, dtype)
    }

    fn rope(
        q: FloatTensor<Self>,
        k: Option<FloatTensor<Self>>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        options: RopeOptions,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        if Self::rope_fused(&B::float_device(&q), q.dtype()) {
            B::rope_kernel(q, k, cos, sin, options)
        } else {
            rope::composite::<B>(q, k, cos, sin, options)
        }
    }

    fn cross_entropy_fused(device: &Device<Self>, dtype: DType) -> bool {
        patches::is_enabled(patches::Op::CrossEntropy) && B::cross_entropy_supported(device, dtype)
    }

    fn cross_entropy(
        logits: FloatTensor<Self>,
        labels: IntTensor<Self>,
        spec: LossSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        if Self::cross_entropy_fused(&B::float_device(&logits), logits.dtype()) {
            let (rows, lse) = B::cross_entropy_kernel(logits, labels, spec);
            (reduce_rows::<B>(rows, &spec), lse)
        } else {
            cross_entropy::composite::<B>(logits, labels, spec)
        }
    }

    fn cross_entropy_backward(
        logits: FloatTensor<Self>,
        labels: IntTensor<Self>,
        lse: FloatTensor<Self>,
        dloss: FloatTensor<Self>,
        spec: LossSpec,
    ) -> FloatTensor<Self> {
        if Self::cross_entropy_fused(&B::float_device(&logits), logits.dtype()) {
            B::cross_entropy_grad_kernel(logits, labels, lse, f32_of::<B>(dloss), spec)
        } else {
            cross_entropy::composite_backward::<B>(logits, labels, lse, dloss, spec)
        }
    }

    fn linear_cross_entropy_fused(device: &Device<Self>, dtype: DType) -> bool {
        patches::is_enabled(patches::Op::FusedLinearCrossEntropy)
            && B::cross_entropy_supported(device, dtype)
    }

    fn linear_cross_entropy(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        labels: IntTensor<Self>,
        spec: LossSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        if Self::linear_cross_entropy_fused(&B::float_device(&hidden), hidden.dtype()) {
            let (rows, lse, _) =
                B::linear_cross_entropy_kernel(hidden, weight, bias, labels, spec, false);
            (reduce_rows::<B>(rows, &spec), lse)
        } else {
            linear_cross_entropy::composite::<B>(hidden, weight, bias, labels, spec)
        }
    }

    fn linear_cross_entropy_with_grads(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        labels: IntTensor<Self>,
        spec: LossSpec,
    ) -> (LossPair<FloatTensor<Self>>, LinearGrads<FloatTensor<Self>>) {
        if Self::linear_cross_entropy_fused(&B::float_device(&hidden), hidden.dtype()) {
            let (rows, lse, grads) =
                B::linear_cross_entropy_kernel(hidden, weight, bias, labels, spec, true);
            let grads = grads.expect("the kernel returns gradients when asked");
            ((reduce_rows::<B>(rows, &spec), lse), grads)
        } else {
            linear_cross_entropy::composite_with_grads::<B>(hidden, weight, bias, labels, spec)
        }
    }

    fn linear_cross_entropy_backward(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        labels: IntTensor<Self>,
        lse: FloatTensor<Self>,
        dloss: FloatTensor<Self>,
        spec: LossSpec,
    ) -> LinearGrads<FloatTensor<Self>> {
        if Self::linear_cross_entropy_fused(&B::float_device(&hidden), hidden.dtype()) {
            B::linear_cross_entropy_backward_kernel(
                hidden,
                weight,
                bias,
                labels,
                lse,
                f32_of::<B>(dloss),
                spec,
            )
        } else {
            linear_cross_entropy::composite_backward::<B>(
                hidden, weight, bias, labels, lse, dloss, spec,
            )
        }
    }

    fn attention_fused(
        device: &Device<Self>,
        dims: &[Shape; 2],
        dtype: DType,
        spec: &AttentionSpec,
    ) -> bool {
        patches::is_enabled(patches::Op::Attention)
            && attention::worth_fusing(dims, B::attention_always_fused(device, dtype))
            && B::attention_supported(device, dims, dtype, spec)
    }

    fn attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        sinks: Option<FloatTensor<Self>>,
        key_lengths: Option<IntTensor<Self>>,
        spec: AttentionSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let dims = [q.shape(), k.shape()];
        if Self::attention_fused(&B::float_device(&q), &dims, q.dtype(), &spec) {
            B::attention_forward_kernel(q, k, v, sinks, key_lengths, spec)
        } else {
            attention::composite_forward::<B>(q, k, v, sinks, key_lengths, spec)
        }
    }

    fn attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        sinks: Option<FloatTensor<Self>>,
        key_lengths: Option<IntTensor<Self>>,
        spec: AttentionSpec,
    ) -> AttentionGrads<FloatTensor<Self>> {
        let dims = [q.shape(), k.shape()];
        if Self::attention_fused(&B::float_device(&q), &dims, q.dtype(), &spec) {
            let sink_dtype = sinks.as_ref().map(|s| s.dtype());
            let mut g =
                B::attention_backward_kernel(q, k, v, out, lse, dout, sinks, key_lengths, spec);
            g.sinks = g.sinks.zip(sink_dtype).map(|(rows, dtype)| {
                let rows = float::<B, 3>(rows);
                let heads = rows.dims()[1];
                rows.sum_dim(0)
                    .sum_dim(2)
                    .reshape([heads])
                    .cast(dtype)
                    .into_primitive()
                    .tensor()
            });
            g
        } else {
            attention::composite_backward::<B>(q, k, v, out, dout, sinks, key_lengths, spec)
        }
    }

    fn adamw_clip(grads: Vec<FloatTensor<Self>>, max_norm: Option<f64>) -> FloatTensor<Self> {
        let device = B::float_device(&grads[0]);
        if grads
            .iter()
            .all(|g| B::elementwise_supported(&device, g.dtype()))
        {
            B::adamw_clip_kernel(grads, max_norm)
        } else {
            adamw::composite_clip::<B>(grads, max_norm)
        }
    }

    fn adamw_update(
        params: Vec<AdamWTensors<FloatTensor<Self>>>,
        grads: Vec<FloatTensor<Self>>,
        clip: Option<FloatTensor<Self>>,
        hyper: AdamWStep,
    ) -> Vec<AdamWTensors<FloatTensor<Self>>> {
        let Some(first) = params.first() else {
            return Vec::new();
        };
        let device = B::float_device(&first.param);
        // The parameters the kernels take go in one call; the others (a
        // dtype the kernels are not built for) run as plain ops.
        let fused: Vec<bool> = params
            .iter()
            .zip(&grads)
            .map(|(state, grad)| {
                [&state.param, grad, &state.moment1]
                    .into_iter()
                    .all(|t| B::elementwise_supported(&device, t.dtype()))
            })
            .collect();
        let (mut kernel, mut composite) = ((vec![], vec![]), (vec![], vec![]));
        for ((state, grad), &fused) in params.into_iter().zip(grads).zip(&fused) {
            let side = if fused { &mut kernel } else { &mut composite };
            side.0.push(state);
            side.1.push(grad);
        }
        let mut kernel = if kernel.0.is_empty() {
            Vec::new()
        } else {
            B::adamw_update_kernel(kernel.0, kernel.1, clip.clone(), hyper)
        }
        .into_iter();
        let mut composite =
            adamw::composite_update_all::<B>(composite.0, composite.1, clip, hyper).into_iter();
        fused
            .into_iter()
            .map(|fused| {
                let next = if fused {
                    kernel.next()
                } else {
                    composite.next()
                };
                next.expect("one updated state per parameter")
            })
            .collect()
    }
}

impl<B: BastileBackend, C: CheckpointStrategy> BastileBackend for Autodiff<B, C> {
    fn rms_norm_fused(device: &Device<Self>, hidden: usize, dtype: DType) -> bool {
        B::rms_norm_fused(device, hidden, dtype)
    }

    fn rms_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        eps: f64,
        cast: RmsNormCast,
    ) -> FloatTensor<Self> {
        rms_norm::autodiff::<B, C>(x, gamma, eps, cast)
    }

    fn swiglu_fused(device: &Device<Self>, dtype: DType) -> bool {
        B::swiglu_fused(device, dtype)
    }

    fn swiglu(input: GluTensors<FloatTensor<Self>>) -> FloatTensor<Self> {
        swiglu::autodiff::<B, C>(input)
    }

    fn geglu_oss_fused(device: &Device<Self>, dtype: DType) -> bool {
        B::geglu_oss_fused(device, dtype)
    }

    fn geglu_oss(x: FloatTensor<Self>, alpha: f64, limit: f64) -> FloatTensor<Self> {
        geglu::autodiff::<B, C>(x, alpha, limit)
    }

    fn rope_fused(device: &Device<Self>, dtype: DType) -> bool {
        B::rope_fused(device, dtype)
    }

    fn rope(
        q: FloatTensor<Self>,
        k: Option<FloatTensor<Self>>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        options: RopeOptions,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        rope::autodiff::<B, C>(q, k, cos, sin, options)
    }

    fn cross_entropy_fused(device: &Device<Self>, dtype: DType) -> bool {
        B::cross_entropy_fused(device, dtype)
    }

    fn cross_entropy(
        logits: FloatTensor<Self>,
        labels: IntTensor<Self>,
        spec: LossSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        cross_entropy::autodiff::<B, C>(logits, labels, spec)
    }

    fn linear_cross_entropy_fused(device: &Device<Self>, dtype: DType) -> bool {
        B::linear_cross_entropy_fused(device, dtype)
    }

    fn linear_cross_entropy(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        labels: IntTensor<Self>,
        spec: LossSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        linear_cross_entropy::autodiff::<B, C>(hidden, weight, bias, labels, spec)
    }

    fn attention_fused(
        device: &Device<Self>,
        dims: &[Shape; 2],
        dtype: DType,
        spec: &AttentionSpec,
    ) -> bool {
        B::attention_fused(device, dims, dtype, spec)
    }

    fn flash_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        sinks: Option<FloatTensor<Self>>,
        key_lengths: Option<IntTensor<Self>>,
        spec: AttentionSpec,
    ) -> FloatTensor<Self> {
        attention::autodiff::<B, C>(q, k, v, sinks, key_lengths, spec)
    }
}

/// Per-token losses reduced as `spec` says (`Mean` / `Sum`: scaled sum).
fn reduce_rows<B: Backend>(rows: FloatTensor<B>, spec: &LossSpec) -> FloatTensor<B> {
    cross_entropy::reduce(float::<B, 1>(rows), spec)
        .into_primitive()
        .tensor()
}

/// The tensor as f32 (upstream gradients may come in any float dtype).
fn f32_of<B: Backend>(t: FloatTensor<B>) -> FloatTensor<B> {
    if t.dtype() == DType::F32 {
        t
    } else {
        B::float_cast(t, DType::F32.into())
    }
}

/// A primitive as a tensor of rank `D`.
pub(crate) fn float<B: Backend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// Errors unless `dtype` is a floating-point dtype.
pub(crate) fn check_float(what: &str, dtype: DType) -> Result<(), BastileError> {
    if matches!(dtype, DType::F32 | DType::F16 | DType::BF16 | DType::F64) {
        Ok(())
    } else {
        Err(BastileError::DType(format!(
            "{what} must be floating point, got {dtype:?}"
        )))
    }
}

/// Errors unless both devices are the same.
pub(crate) fn check_same_device<D: PartialEq + core::fmt::Debug>(
    a_what: &str,
    a: &D,
    b_what: &str,
    b: &D,
) -> Result<(), BastileError> {
    if a == b {
        Ok(())
    } else {
        Err(BastileError::Device(format!(
            "{a_what} is on {a:?} but {b_what} is on {b:?}"
        )))
    }
}
