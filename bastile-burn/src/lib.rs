//! # Bastile
//!
//! Fused, autotuned GPU training kernels for [Burn](https://burn.dev), as a
//! backend decorator. Wrap your backend in [`Bastile`] and the
//! normalization, activation, rotary-embedding and loss calls of your model
//! run as fused CubeCL kernels, forward and backward:
//!
//! ```rust
//! use burn::backend::{Autodiff, NdArray};
//! use burn::tensor::{Distribution, Tensor};
//! use bastile::{Bastile, nn::RmsNormConfig};
//!
//! // On a GPU: `Autodiff<Bastile<bastile::CudaDirect>>` (feature `cuda`) or
//! // `Autodiff<Bastile<burn::backend::Wgpu>>` (feature `wgpu`).
//! type B = Autodiff<Bastile<NdArray>>;
//!
//! bastile::apply(bastile::Patches::default()); // every fused op on
//! let device = Default::default();
//! let norm = RmsNormConfig::new(64).init::<B>(&device);
//! let x = Tensor::<B, 3>::random([2, 5, 64], Distribution::Normal(0.0, 1.0), &device)
//!     .require_grad();
//! let y = norm.try_forward(x.clone())?;
//! let grads = y.sum().backward();
//! assert_eq!(x.grad(&grads).unwrap().dims(), [2, 5, 64]);
//! # Ok::<(), bastile::BastileError>(())
//! ```
//!
//! * [`BastileBackend`] holds the fused ops. Each has a composite default
//!   written with plain Burn ops (the reference semantics), so every Burn
//!   backend implements it; `Bastile<B>` overrides them with kernels, and
//!   `Autodiff<B>` gives each fused op a single autodiff node whose backward
//!   is the fused backward kernel.
//! * The fused ops, each with a checked entry point: [`rms_norm`],
//!   [`swiglu`] / [`swiglu_packed`], [`geglu_oss`] (GPT-OSS experts),
//!   [`rope`] / [`rope_one`] with [`RopeTables`], [`linear_cross_entropy`]
//!   (the LM head and its loss without materialized logits) and
//!   [`cross_entropy`] on given logits, with [`CrossEntropyOptions`],
//!   [`linear`] (a projection as one node) and [`batched_linear`] (a batch
//!   of them, e.g. a mixture's experts), [`lora_linear`] (a linear
//!   layer with a LoRA adapter) and
//!   [`lora_update`] (the adapter alone), [`embedding`] (the token
//!   lookup, whose gradient is added into a tied output layer's in place,
//!   see also [`add_embedding_grad`]), [`gather_rows`] (rows gathered by an
//!   index whose inverse gathers their gradient back: routed experts) and
//!   [`router_top_k`] (a router's top-k experts and their softmax weights,
//!   chosen on the device).
//! * [`apply`], [`reset`], [`patched_ops`] switch ops on and off at run time;
//!   a disabled op takes the composite path.
//! * [`nn`] has drop-in replacements for the matching `burn::nn` modules.

/// The README's example is compiled and run as a doc test.
#[doc = include_str!("../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

mod backend;
mod error;
pub mod fused;
pub mod graph;
pub mod kernel_cache;
pub mod launch_failure;
pub mod nn;
pub mod ops;
pub mod optim;
mod patches;

pub use backend::Bastile;

/// Burn's CUDA backend without its fusion stream: `CubeBackend` over
/// CubeCL's CUDA runtime, every op launched from the thread that calls it.
///
/// `burn::backend::Cuda` is `Fusion<CubeBackend>`: each op first goes
/// through the stream of Burn's fusion thread, which looks for element-wise
/// chains to fuse. Under [`Bastile`] the fused kernels already cover those
/// chains, and a dense model's training step spends less host time per op
/// without that stream; `Autodiff<Bastile<CudaDirect>>` is the backend the
/// `bastile` command runs dense models on, on one GPU and data-parallel (a
/// mixture of experts measured faster on the stream).
#[cfg(feature = "cuda")]
pub type CudaDirect<F = f32, I = i32> =
    burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, F, I, u8>;
pub use bastile_cubecl::rms_norm::RmsNormCast;
pub use bastile_cubecl::tune::{TUNE_VAR, TunePolicy, set_tune_policy, tune_policy};
pub use error::BastileError;
pub use fused::BastileBackend;
pub use launch_failure::{LaunchFailure, capture_launch_failures, launch_failed};
pub use ops::attention::{
    AttentionKernels, AttentionOptions, attention, attention_kernels, deterministic_attention,
    document_starts, set_attention_kernels, set_deterministic_attention,
};
pub use ops::combine_rows::combine_rows;
pub use ops::cross_entropy::{
    CrossEntropyOptions, CrossEntropyOutput, LabelCheck, Reduction, WeightGradSum, cross_entropy,
    first_flagged,
};
pub use ops::embedding::{add_embedding_grad, embedding};
pub use ops::expert_groups::{ExpertGroups, group_by_expert, group_capacity};
pub use ops::gather_rows::gather_rows;
pub use ops::geglu::geglu_oss;
pub use ops::linear::{batched_linear, linear};
pub use ops::linear_cross_entropy::{LinearGrads, linear_cross_entropy};
pub use ops::lora::{lora_linear, lora_update};
pub use ops::rms_norm::rms_norm;
pub use ops::rope::{RopeLayout, RopeOptions, RopePairing, RopeTables, rope, rope_one};
pub use ops::router::router_top_k;
pub use ops::swiglu::{GluTensors, swiglu, swiglu_packed};
pub use patches::{Op, Patches, apply, patched_ops, reset};

/// Lets f32 matmuls on cuBLASLt use TF32 tensor cores (products with a
/// 10-bit mantissa, several times faster). Off by default, so f32 training
/// stays f32; bf16/f16 matmuls always accumulate in f32. Without the `cuda`
/// feature there is no cuBLASLt path and this does nothing.
pub fn allow_tf32(allow: bool) {
    #[cfg(feature = "cuda")]
    bastile_cubecl::cublaslt::set_tf32(allow);
    #[cfg(not(feature = "cuda"))]
    let _ = allow;
}

/// The loaded cuDNN's version (`major·10000 + minor·100 + patch`), `None`
/// without the `cuda` feature or when `libcudnn.so.9` is not found. Where
/// it is loaded, the fused attention runs on cuDNN's kernels for the
/// problems they take ([`AttentionKernels::Auto`]).
pub fn cudnn_version() -> Option<usize> {
    #[cfg(feature = "cuda")]
    return bastile_cubecl::cudnn::version();
    #[cfg(not(feature = "cuda"))]
    None
}

/// Orders cuBLASLt matmuls by host synchronization around a stream of
/// their own instead of enqueuing them on CubeCL's stream (the default when
/// that stream can be observed, which needs CUPTI). Slower; for comparison
/// and debugging. `BASTILE_MATMUL_ORDER=host-sync` does the same.
pub fn matmul_host_sync(force: bool) {
    #[cfg(feature = "cuda")]
    bastile_cubecl::cublaslt::force_host_sync(force);
    #[cfg(not(feature = "cuda"))]
    let _ = force;
}

/// Forgets the launch configurations autotuned in this process, so the
/// next call of each op tunes again under [`TunePolicy::Full`] (CubeCL's
/// on-disk cache is kept).
pub fn clear_autotune_cache() {
    bastile_cubecl::attention::clear_autotune();
    bastile_cubecl::attention::mma::clear_autotune();
    bastile_cubecl::rms_norm::clear_autotune();
    bastile_cubecl::glu::clear_autotune();
    bastile_cubecl::rope::clear_autotune();
    bastile_cubecl::cross_entropy::clear_autotune();
}

/// Compiles and autotunes every enabled fused kernel on `device` for small
/// representative shapes, so the first training step does not pay for it.
pub fn warmup_all_kernels<B: BastileBackend>(device: &B::Device) {
    ops::rms_norm::warmup::<B>(device);
    ops::swiglu::warmup::<B>(device);
    ops::geglu::warmup::<B>(device);
    ops::rope::warmup::<B>(device);
    ops::attention::warmup::<B>(device);
    ops::linear_cross_entropy::warmup::<B>(device);
}
