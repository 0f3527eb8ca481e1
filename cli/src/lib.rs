//! The `bastile` command as a library: `finetune` trains a Qwen3, Llama
//! 3.x or GPT-OSS model on a JSONL instruction data set (with Bastile's
//! fused kernels, or without for the baseline) and exports it in Hugging
//! Face's format; `generate` answers prompts from one or more models, so a
//! base model and its finetuned version can be compared side by side.

pub mod batches;
pub mod chat;
pub mod data;
pub mod device;
mod error;
pub mod finetune;
pub mod generate;
pub mod source;
pub mod tokenizer;

use burn::tensor::DType;
use clap::ValueEnum;

pub use error::CliError;

/// The parameter dtype of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DTypeArg {
    /// bf16 on CUDA, f32 elsewhere.
    Auto,
    F32,
    Bf16,
    F16,
}

impl DTypeArg {
    pub fn resolve(self, auto: DType) -> Result<DType, CliError> {
        Ok(match self {
            Self::Auto => auto,
            Self::F32 => DType::F32,
            Self::Bf16 => DType::BF16,
            Self::F16 => DType::F16,
        })
    }
}
