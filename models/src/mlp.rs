//! The feed-forward block: the SwiGLU MLP (Qwen3, Llama) or GPT-OSS's
//! mixture of experts.

use bastile::nn::{SwiGluMlp, SwiGluMlpConfig};
use bastile::{BastileBackend, swiglu};
use burn::module::Module;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use crate::ModelError;
use crate::config::ModelConfig;
use crate::lora::{LoraAdapter, MlpAdapters, project};
use crate::moe::{Moe, RouterLoad};

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
    /// `x` `[batch, seq, hidden]` → `[batch, seq, hidden]`; `adapters` add
    /// their LoRA updates to the dense MLP's projections, or to the
    /// router's and experts'. With
    /// `router_load`, the experts' [`RouterLoad`] comes along (a dense MLP
    /// has none).
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        adapters: Option<&MlpAdapters<B>>,
        router_load: bool,
    ) -> Result<(Tensor<B, 3>, Option<RouterLoad<B>>), ModelError> {
        match self {
            Mlp::Dense(mlp) => {
                let adapter = |pick: fn(&MlpAdapters<B>) -> &Option<LoraAdapter<B>>| {
                    adapters.and_then(|a| pick(a).as_ref())
                };
                let gate = project(&mlp.gate_proj, adapter(|a| &a.gate_proj), x.clone())?;
                let up = project(&mlp.up_proj, adapter(|a| &a.up_proj), x)?;
                let h = swiglu(gate, up)?;
                Ok((project(&mlp.down_proj, adapter(|a| &a.down_proj), h)?, None))
            }
            Mlp::Experts(moe) => moe.forward_with_load(x, adapters, router_load),
        }
    }
}
