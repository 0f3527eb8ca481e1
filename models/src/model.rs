//! The decoder-only causal LM shared by Qwen3, Llama and GPT-OSS, with HF's
//! module tree (`model.embed_tokens`, `model.layers.N.{input_layernorm,
//! self_attn, post_attention_layernorm, mlp}`, `model.norm`, `lm_head`).
//! Norms, activations, RoPE and the loss go through [`BastileBackend`]: the
//! same code is the baseline on a plain backend and fused under `Bastile`.

use bastile::nn::{RmsNorm, RmsNormConfig, rope_frequencies};
use bastile::{
    BastileBackend, CrossEntropyOptions, CrossEntropyOutput, RopeTables, linear_cross_entropy,
};
use burn::module::{Module, ModuleMapper, Param};
use burn::nn::{Embedding, EmbeddingConfig, Initializer};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Tensor};

use crate::ModelError;
use crate::attention::Attention;
use crate::config::{HfConfig, ModelConfig};
use crate::mlp::Mlp;

/// One transformer block.
#[derive(Module, Debug)]
pub struct Layer<B: Backend> {
    pub input_layernorm: RmsNorm<B>,
    pub self_attn: Attention<B>,
    pub post_attention_layernorm: RmsNorm<B>,
    pub mlp: Mlp<B>,
}

/// HF's `model`: embeddings, blocks, final norm.
#[derive(Module, Debug)]
pub struct Decoder<B: Backend> {
    pub embed_tokens: Embedding<B>,
    pub layers: Vec<Layer<B>>,
    pub norm: RmsNorm<B>,
}

/// The output projection, stored `[vocab, hidden]` as HF stores it (the
/// fused loss takes it as is).
#[derive(Module, Debug)]
pub struct LmHead<B: Backend> {
    pub weight: Param<Tensor<B, 2>>,
}

/// RoPE's inverse frequencies and attention scaling (not parameters).
#[derive(Clone, Debug)]
pub struct Rotary {
    pub inv_freq: Vec<f32>,
    pub scaling: f32,
}

/// A causal language model. `lm_head` is `None` when the embeddings are
/// tied.
#[derive(Module, Debug)]
pub struct CausalLm<B: Backend> {
    pub model: Decoder<B>,
    pub lm_head: Option<LmHead<B>>,
    #[module(skip)]
    pub config: ModelConfig,
    #[module(skip)]
    pub hf_config: HfConfig,
    #[module(skip)]
    pub rotary: Rotary,
}

impl<B: Backend> CausalLm<B> {
    /// A randomly initialized model for `config` (normal, std 0.02, as HF's
    /// `initializer_range`; norms at one). Parameters are created lazily,
    /// so loading a checkpoint over it costs no extra initialization.
    pub fn init(hf_config: &HfConfig, device: &B::Device) -> Result<Self, ModelError> {
        let config = hf_config.resolve()?;
        let (inv_freq, scaling) =
            rope_frequencies(config.head_dim, config.rope_theta, &config.rope_scaling)?;
        let norm = |d| {
            RmsNormConfig::new(d)
                .with_epsilon(config.rms_norm_eps)
                .with_cast(config.norm_cast)
                .init(device)
        };
        let normal = Initializer::Normal {
            mean: 0.0,
            std: 0.02,
        };
        let h = config.hidden_size;
        let layers = (0..config.layers)
            .map(|i| Layer {
                input_layernorm: norm(h),
                self_attn: Attention::new(&config, i, device),
                post_attention_layernorm: norm(h),
                mlp: Mlp::new(&config, device),
            })
            .collect();
        Ok(CausalLm {
            model: Decoder {
                embed_tokens: EmbeddingConfig::new(config.vocab_size, h)
                    .with_initializer(normal.clone())
                    .init(device),
                layers,
                norm: norm(h),
            },
            lm_head: (!config.tie_word_embeddings).then(|| LmHead {
                weight: normal.init([config.vocab_size, h], device),
            }),
            config,
            hf_config: hf_config.clone(),
            rotary: Rotary { inv_freq, scaling },
        })
    }

    /// The model with every parameter cast to `dtype` (e.g. bf16 weights
    /// for training; the loss, softmax and norm statistics stay in f32).
    /// Errors on a dtype that is not floating point.
    pub fn with_dtype(self, dtype: DType) -> Result<Self, ModelError> {
        if !dtype.is_float() {
            return Err(bastile::BastileError::DType(format!(
                "model parameters must be floating point, got {dtype:?}"
            ))
            .into());
        }
        Ok(self.map(&mut CastParams(dtype)))
    }

    /// The output projection `[vocab, hidden]` (the embeddings when tied).
    pub fn head_weight(&self) -> Tensor<B, 2> {
        match &self.lm_head {
            Some(head) => head.weight.val(),
            None => self.model.embed_tokens.weight.val(),
        }
    }

    fn check_ids(&self, ids: &Tensor<B, 2, Int>) -> Result<(), ModelError> {
        let [b, s] = ids.dims();
        if b == 0 || s == 0 {
            return Err(bastile::BastileError::Shape(format!(
                "input ids must be a non-empty [batch, seq] tensor, got [{b}, {s}]"
            ))
            .into());
        }
        Ok(())
    }
}

impl<B: BastileBackend> CausalLm<B> {
    /// The final hidden states `[batch, seq, hidden]` of token ids
    /// `[batch, seq]`.
    pub fn hidden(&self, ids: Tensor<B, 2, Int>) -> Result<Tensor<B, 3>, ModelError> {
        self.check_ids(&ids)?;
        let [_, s] = ids.dims();
        let device = ids.device();
        let tables = RopeTables::new(s, &self.rotary.inv_freq, self.rotary.scaling, &device);
        let mut x = self.model.embed_tokens.forward(ids);
        for layer in &self.model.layers {
            let a = layer
                .self_attn
                .forward(layer.input_layernorm.try_forward(x.clone())?, &tables)?;
            x = x + a;
            let m = layer
                .mlp
                .forward(layer.post_attention_layernorm.try_forward(x.clone())?)?;
            x = x + m;
        }
        Ok(self.model.norm.try_forward(x)?)
    }

    /// Logits `[batch, seq, vocab]` (materialized: for inference and
    /// tests; training uses [`CausalLm::loss`]).
    pub fn logits(&self, ids: Tensor<B, 2, Int>) -> Result<Tensor<B, 3>, ModelError> {
        let x = self.hidden(ids)?;
        Ok(x.matmul(self.head_weight().transpose().unsqueeze()))
    }

    /// HF's causal-LM loss: `labels` `[batch, seq]` are the token ids to
    /// predict at each position (shifted here: position `t` predicts
    /// `labels[t + 1]`), with `options.ignore_index` (-100) for positions
    /// that do not count (padding, prompt). Through the fused linear
    /// cross-entropy: the logits are never materialized under `Bastile`.
    pub fn loss(
        &self,
        ids: Tensor<B, 2, Int>,
        labels: Tensor<B, 2, Int>,
        options: CrossEntropyOptions,
    ) -> Result<CrossEntropyOutput<B>, ModelError> {
        let [b, s] = ids.dims();
        let [lb, ls] = labels.dims();
        if (lb, ls) != (b, s) {
            return Err(bastile::BastileError::Shape(format!(
                "labels are [{lb}, {ls}] but input ids are [{b}, {s}]"
            ))
            .into());
        }
        let shifted = Tensor::cat(
            vec![
                labels.clone().narrow(1, 1, s - 1),
                Tensor::full([b, 1], options.ignore_index, &labels.device()),
            ],
            1,
        );
        let x = self.hidden(ids)?;
        let h = self.config.hidden_size;
        Ok(linear_cross_entropy(
            x.reshape([b * s, h]),
            self.head_weight(),
            None,
            shifted.reshape([b * s]),
            options,
        )?)
    }
}

/// Casts every float parameter, keeping its id and whether it trains.
struct CastParams(DType);

impl<B: Backend> ModuleMapper<B> for CastParams {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let trains = tensor.is_require_grad();
        let cast = tensor.cast(self.0).detach();
        let cast = if trains { cast.require_grad() } else { cast };
        Param::from_mapped_value(id, cast, mapper)
    }
}
