//! Qwen3, Llama 3.x and GPT-OSS in Burn, generic over
//! [`bastile::BastileBackend`]: the same model code is the baseline under
//! `Autodiff<Cuda>` and runs Bastile's fused kernels under
//! `Autodiff<Bastile<Cuda>>` (or `Autodiff<Bastile<bastile::CudaDirect>>`,
//! without Burn's fusion stream, which queues a dense model's step
//! faster). Hugging Face checkpoints load with [`CausalLm::from_hf_dir`]
//! and save with [`CausalLm::save_hf_dir`]; [`presets`] names the
//! published sizes so nothing needs a download.

pub mod attention;
pub mod checkpointing;
pub mod clip;
pub mod config;
mod error;
mod hf;
pub mod lora;
pub mod mlp;
pub mod model;
pub mod moe;
pub mod parallel;
pub mod precompile;
pub mod presets;
pub mod train;

pub use checkpointing::Checkpointing;
pub use config::{Architecture, HfConfig, ModelConfig, MoeConfig};
pub use error::ModelError;
pub use lora::{LoraConfig, LoraTarget};
pub use model::{CausalLm, packed_labels};
pub use moe::ExpertRouting;
pub use parallel::{Collective, DataParallelOptions};
pub use train::{MicroBatch, OptimizerKind, StepOutput, TrainConfig, Trainer};
