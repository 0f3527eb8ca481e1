//! The `bastile` command as a library: `finetune` trains a Qwen3, Llama
//! 3.x or GPT-OSS model on a JSONL instruction data set (with Bastile's
//! fused kernels, or without for the baseline) and exports it in Hugging
//! Face's format; `generate` answers prompts from one or more models, so a
//! base model and its finetuned version can be compared side by side;
//! `warmup` compiles the kernels a model's training will need ahead of it.

pub mod batches;
pub mod chat;
pub mod checkpoint;
pub mod data;
pub mod device;
mod error;
pub mod eval;
pub mod finetune;
pub mod generate;
pub mod source;
pub mod tokenizer;
pub mod warmup;

use bastile::WeightGradSum;
use bastile_models::ExpertRouting;
use burn::tensor::DType;
use clap::ValueEnum;

use crate::device::{DeviceKind, RunInfo};

pub use error::CliError;

/// How a mixture of experts runs them (`--experts` of the command and the
/// benchmark).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ExpertsArg {
    /// Each expert on the tokens the router sent it.
    Routed,
    /// Every expert on every token, weighted 0 where not chosen.
    Dense,
}

impl ExpertsArg {
    pub fn routing(self) -> ExpertRouting {
        match self {
            Self::Routed => ExpertRouting::Routed,
            Self::Dense => ExpertRouting::Dense,
        }
    }

    /// The name the flag takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::Routed => "routed",
            Self::Dense => "dense",
        }
    }
}

/// How the fused loss sums the output layer's gradient over its chunks of
/// tokens (`--loss-weight-grad-sum` of the command and the benchmark).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum WeightGradSumArg {
    /// Each chunk's product added in the weight's dtype (Liger-Kernel's
    /// numerics; the default).
    Chunks,
    /// A second pass over slices of the vocabulary; the gradient rounded
    /// once.
    Exact,
}

impl From<WeightGradSum> for WeightGradSumArg {
    fn from(sum: WeightGradSum) -> Self {
        match sum {
            WeightGradSum::Exact => Self::Exact,
            WeightGradSum::Chunks => Self::Chunks,
        }
    }
}

impl WeightGradSumArg {
    pub fn sum(self) -> WeightGradSum {
        match self {
            Self::Exact => WeightGradSum::Exact,
            Self::Chunks => WeightGradSum::Chunks,
        }
    }

    /// The name the flag takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::Exact => "exact",
            Self::Chunks => "chunks",
        }
    }
}

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
    /// The dtype on the run's device: `auto` is bf16 on CUDA and f32
    /// elsewhere; half precision anywhere but CUDA is an error.
    pub fn resolve(self, info: &RunInfo) -> Result<DType, CliError> {
        let cuda = info.device == DeviceKind::Cuda;
        let dtype = match self {
            Self::Auto if cuda => DType::BF16,
            Self::Auto | Self::F32 => DType::F32,
            Self::Bf16 => DType::BF16,
            Self::F16 => DType::F16,
        };
        if !cuda && dtype != DType::F32 {
            return Err(CliError::Usage(format!(
                "--dtype {dtype:?} needs --device cuda; run in f32 elsewhere"
            )));
        }
        Ok(dtype)
    }
}
