//! The feed-forward block: the SwiGLU MLP (Qwen3, Llama) or GPT-OSS's
//! mixture of experts.

use bastile::BastileBackend;
use bastile::nn::{SwiGluMlp, SwiGluMlpConfig};
use burn::module::Module;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use crate::ModelError;
use crate::config::ModelConfig;
use crate::moe::Moe;

/// HF's `mlp` (variant names are not part of the parameter paths).
#[derive(Module, Debug)]
pub enum Mlp<B: Backend> {
    Dense(SwiGluMlp<B>),
    Experts(Moe<B>),
}

impl<B: Backend> Mlp<B> {
    pub fn new(config: &ModelConfig, device: &B::Device) -> Self {
        match config.moe {
            Some(moe) => Mlp::Experts(Moe::new(
                config.hidden_size,
                config.intermediate_size,
                moe,
                device,
            )),
            None => Mlp::Dense(
                SwiGluMlpConfig::new(config.hidden_size, config.intermediate_size)
                    .with_bias(config.mlp_bias)
                    .init(device),
            ),
        }
    }
}

impl<B: BastileBackend> Mlp<B> {
    pub fn forward(&self, x: Tensor<B, 3>) -> Result<Tensor<B, 3>, ModelError> {
        match self {
            Mlp::Dense(mlp) => Ok(mlp.forward(x)),
            Mlp::Experts(moe) => moe.forward(x),
        }
    }
}
