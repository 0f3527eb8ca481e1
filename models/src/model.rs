//! The decoder-only causal LM shared by Qwen3, Llama and GPT-OSS, with HF's
//! module tree (`model.embed_tokens`, `model.layers.N.{input_layernorm,
//! self_attn, post_attention_layernorm, mlp}`, `model.norm`, `lm_head`).
//! Norms, activations, RoPE and the loss go through [`BastileBackend`]: the
//! same code is the baseline on a plain backend and fused under `Bastile`.

use bastile::nn::{RmsNorm, RmsNormConfig, rope_frequencies};
use bastile::{
    BastileBackend, CrossEntropyOptions, CrossEntropyOutput, Reduction, RopeTables,
    linear_cross_entropy,
};
use burn::module::{Module, ModuleMapper, Param};
use burn::nn::{Embedding, EmbeddingConfig, Initializer};
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, DType, Int, Tensor};

use crate::ModelError;
use crate::attention::Attention;
use crate::checkpointing::Checkpointing;
use crate::config::{HfConfig, ModelConfig};
use crate::lora::{LayerAdapters, LoraConfig};
use crate::mlp::Mlp;
use crate::moe::RouterLoad;

/// One transformer block.
#[derive(Module, Debug)]
pub struct Layer<B: Backend> {
    pub input_layernorm: RmsNorm<B>,
    pub self_attn: Attention<B>,
    pub post_attention_layernorm: RmsNorm<B>,
    pub mlp: Mlp<B>,
    /// LoRA adapters of the layer's projections ([`CausalLm::with_lora`]).
    pub lora: Option<LayerAdapters<B>>,
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
    /// The config of the layers' LoRA adapters, when they have them.
    #[module(skip)]
    pub lora: Option<LoraConfig>,
    /// Which layers recompute their activations in training
    /// ([`CausalLm::with_checkpointing`]).
    #[module(skip)]
    pub checkpointing: Checkpointing,
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
                lora: None,
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
            lora: None,
            checkpointing: Checkpointing::Off,
        })
    }

    /// The model with every parameter cast to `dtype` (e.g. bf16 weights
    /// for training; the loss, softmax and norm statistics stay in f32).
    /// LoRA adapters keep their own dtype ([`LoraConfig::dtype`]). Errors
    /// on a dtype that is not floating point.
    pub fn with_dtype(mut self, dtype: DType) -> Result<Self, ModelError> {
        if !dtype.is_float() {
            return Err(bastile::BastileError::DType(format!(
                "model parameters must be floating point, got {dtype:?}"
            ))
            .into());
        }
        let adapters: Vec<_> = self
            .model
            .layers
            .iter_mut()
            .map(|l| l.lora.take())
            .collect();
        let mut model = self.map(&mut CastParams(dtype));
        for (layer, lora) in model.model.layers.iter_mut().zip(adapters) {
            layer.lora = lora;
        }
        Ok(model)
    }

    /// The output projection `[vocab, hidden]` (the embeddings when tied).
    pub fn head_weight(&self) -> Tensor<B, 2> {
        match &self.lm_head {
            Some(head) => head.weight.val(),
            None => self.model.embed_tokens.weight.val(),
        }
    }

    /// Non-empty ids, and packed positions of their shape.
    fn check_shape(
        &self,
        ids: &Tensor<B, 2, Int>,
        positions: Option<&Tensor<B, 2, Int>>,
    ) -> Result<(), ModelError> {
        let [b, s] = ids.dims();
        if b == 0 || s == 0 {
            return Err(bastile::BastileError::Shape(format!(
                "input ids must be a non-empty [batch, seq] tensor, got [{b}, {s}]"
            ))
            .into());
        }
        if let Some(p) = positions
            && p.dims() != [b, s]
        {
            return Err(bastile::BastileError::Shape(format!(
                "packed positions are {:?} but input ids are [{b}, {s}]",
                p.dims()
            ))
            .into());
        }
        Ok(())
    }

    /// Queues the check of `ids` against the vocabulary, on the device
    /// (nothing is read): see [`IdCheck`].
    pub fn check_token_ids(&self, ids: &Tensor<B, 2, Int>) -> IdCheck<B> {
        IdCheck::new(ids, self.config.vocab_size)
    }
}

/// The first token id of a `[batch, seq]` batch outside `[0, vocab)`,
/// looked for on the device so that a training step can read it with its
/// other results instead of waiting for it.
#[derive(Clone)]
pub struct IdCheck<B: Backend> {
    /// `[position, id]` of the first offending id (row-major position;
    /// `batch · seq` when there is none).
    found: Tensor<B, 1, Int>,
    seq: usize,
    positions: usize,
    vocab: usize,
}

impl<B: Backend> IdCheck<B> {
    fn new(ids: &Tensor<B, 2, Int>, vocab: usize) -> Self {
        let [b, seq] = ids.dims();
        let positions = b * seq;
        let flat = ids.clone().reshape([positions]);
        let bad = flat
            .clone()
            .lower_elem(0)
            .bool_or(flat.clone().greater_equal_elem(vocab as i64));
        Self {
            found: bastile::first_flagged(&flat, bad),
            seq,
            positions,
            vocab,
        }
    }

    /// `[position, id]` of the first offending id, on the device.
    pub fn found(&self) -> Tensor<B, 1, Int> {
        self.found.clone()
    }

    /// `[1]` on the device: whether an id is out of range.
    pub fn failed(&self) -> Tensor<B, 1, Bool> {
        self.found
            .clone()
            .slice(0..1)
            .lower_elem(self.positions as i64)
    }

    /// What `found`, the values of [`IdCheck::found`], report; `None` when
    /// every id is in the vocabulary.
    pub fn error(&self, found: [i64; 2]) -> Option<String> {
        let [position, id] = found;
        (position < self.positions as i64).then(|| {
            let p = position as usize;
            format!(
                "input id {id} at row {}, column {} is outside the vocabulary [0, {})",
                p / self.seq,
                p % self.seq,
                self.vocab
            )
        })
    }

    /// Reads the check (this waits for the device).
    pub fn result(self) -> Result<(), ModelError> {
        let found: Vec<i64> = self
            .found
            .clone()
            .into_data()
            .convert::<i64>()
            .into_vec()
            .map_err(|e| ModelError::Config(format!("input ids could not be read: {e:?}")))?;
        match self.error([found[0], found[1]]) {
            Some(e) => Err(bastile::BastileError::Shape(e).into()),
            None => Ok(()),
        }
    }
}

impl<B: BastileBackend> CausalLm<B> {
    /// The final hidden states `[batch, seq, hidden]` of token ids
    /// `[batch, seq]`. An id outside the vocabulary is an error (the ids
    /// are checked on the device and the answer read back first).
    pub fn hidden(&self, ids: Tensor<B, 2, Int>) -> Result<Tensor<B, 3>, ModelError> {
        self.hidden_of(ids, None)
    }

    /// [`CausalLm::hidden`] of rows that pack several documents:
    /// `positions` (`[batch, seq]`) holds each token's place in its
    /// document, 0 where one starts. Each token attends only to its own
    /// document and its RoPE angle is its place in it, so every document
    /// gets the hidden states it would get alone in a row.
    pub fn hidden_packed(
        &self,
        ids: Tensor<B, 2, Int>,
        positions: Tensor<B, 2, Int>,
    ) -> Result<Tensor<B, 3>, ModelError> {
        self.hidden_of(ids, Some(positions))
    }

    fn hidden_of(
        &self,
        ids: Tensor<B, 2, Int>,
        positions: Option<Tensor<B, 2, Int>>,
    ) -> Result<Tensor<B, 3>, ModelError> {
        self.check_shape(&ids, positions.as_ref())?;
        self.check_token_ids(&ids).result()?;
        let (x, _) = self.decode(ids, positions, false)?;
        Ok(self.model.norm.try_forward(x)?)
    }

    /// The layers' output for ids already checked (or clamped), before the
    /// final norm, and with `router_loads` the loads of the layers'
    /// routers (none without experts).
    fn decode(
        &self,
        ids: Tensor<B, 2, Int>,
        positions: Option<Tensor<B, 2, Int>>,
        router_loads: bool,
    ) -> Result<(Tensor<B, 3>, Vec<RouterLoad<B>>), ModelError> {
        let tables = self.rope_tables(&ids, positions.as_ref());
        let mut x = bastile::embedding(self.model.embed_tokens.weight.val(), ids)?;
        let mut loads = Vec::new();
        for layer in &self.model.layers {
            let (out, load) = layer.forward(x, &tables, positions.as_ref(), router_loads)?;
            x = out;
            loads.extend(load);
        }
        Ok((x, loads))
    }

    /// The weight of the router's load-balancing loss beside a
    /// cross-entropy `out` reduced as `options` say, `[1]`: its coefficient,
    /// times the counted tokens for a sum (over a normalizer, for a mean
    /// with one), so the micro-batches of a step weigh it by their tokens
    /// as they weigh their cross-entropy. `None` without that loss.
    pub(crate) fn router_aux_scale(
        &self,
        out: &CrossEntropyOutput<B>,
        options: CrossEntropyOptions,
    ) -> Result<Option<Tensor<B, 1>>, ModelError> {
        let Some(coef) = self.router_aux_loss() else {
            return Ok(None);
        };
        let tokens = || out.tokens.clone().float().cast(DType::F32);
        Ok(Some(match (options.reduction, options.normalizer) {
            (Reduction::Mean, None) => {
                Tensor::<B, 1>::from_floats([coef], &out.loss.device()).cast(DType::F32)
            }
            (Reduction::Mean, Some(normalizer)) => tokens() * (coef / normalizer),
            (Reduction::Sum, _) => tokens() * coef,
            (Reduction::None, _) => {
                return Err(ModelError::Config(
                    "the router's load-balancing loss is added to a reduced loss (Mean or \
                     Sum), not to per-token losses"
                        .into(),
                ));
            }
        }))
    }

    /// RoPE's tables for rows of `ids`: each token's place in its row, or
    /// in its document when `positions` pack several.
    pub(crate) fn rope_tables(
        &self,
        ids: &Tensor<B, 2, Int>,
        positions: Option<&Tensor<B, 2, Int>>,
    ) -> RopeTables<B> {
        let (inv_freq, scaling) = (&self.rotary.inv_freq, self.rotary.scaling);
        match positions {
            Some(p) => RopeTables::for_positions(p.clone(), inv_freq, scaling),
            None => RopeTables::new(ids.dims()[1], inv_freq, scaling, &ids.device()),
        }
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
    ///
    /// Rows need at least two positions (a token and the one it
    /// predicts). Input ids outside the vocabulary are an error, read back
    /// before the forward pass; with
    /// [`CrossEntropyOptions::with_deferred_label_check`] nothing is read:
    /// the ids are clamped into the vocabulary for the lookup and the
    /// caller checks them with [`CausalLm::check_token_ids`], as it checks
    /// the labels.
    pub fn loss(
        &self,
        ids: Tensor<B, 2, Int>,
        labels: Tensor<B, 2, Int>,
        options: CrossEntropyOptions,
    ) -> Result<CrossEntropyOutput<B>, ModelError> {
        self.loss_of(ids, labels, None, options)
    }

    /// [`CausalLm::loss`] of rows that pack several documents (see
    /// [`CausalLm::hidden_packed`]): the loss of each document alone, its
    /// last token not trained to predict the next document's first
    /// ([`packed_labels`]).
    pub fn loss_packed(
        &self,
        ids: Tensor<B, 2, Int>,
        labels: Tensor<B, 2, Int>,
        positions: Tensor<B, 2, Int>,
        options: CrossEntropyOptions,
    ) -> Result<CrossEntropyOutput<B>, ModelError> {
        self.loss_of(ids, labels, Some(positions), options)
    }

    /// [`CausalLm::loss`], or [`CausalLm::loss_packed`] with `positions`.
    pub fn loss_of(
        &self,
        ids: Tensor<B, 2, Int>,
        labels: Tensor<B, 2, Int>,
        positions: Option<Tensor<B, 2, Int>>,
        options: CrossEntropyOptions,
    ) -> Result<CrossEntropyOutput<B>, ModelError> {
        let input = self.loss_input(ids, labels, positions, options)?;
        let router_loads = self.router_aux_loss().is_some();
        let (x, loads) = self.decode(input.ids, input.positions, router_loads)?;
        let mut out = self.head_loss(x, input.shifted, options)?;
        if let Some(scale) = self.router_aux_scale(&out, options)?
            && let Some(weights) = RouterLoad::loss_weights(&loads)
            && let Some(aux) = RouterLoad::loss(&loads, weights * scale)
        {
            out.loss = out.loss + aux;
        }
        Ok(out)
    }

    /// The checked (or, with a deferred label check, clamped) ids and the
    /// shifted labels of [`CausalLm::loss`].
    pub(crate) fn loss_input(
        &self,
        ids: Tensor<B, 2, Int>,
        labels: Tensor<B, 2, Int>,
        positions: Option<Tensor<B, 2, Int>>,
        options: CrossEntropyOptions,
    ) -> Result<LossInput<B>, ModelError> {
        self.check_shape(&ids, positions.as_ref())?;
        let [b, s] = ids.dims();
        let [lb, ls] = labels.dims();
        if (lb, ls) != (b, s) {
            return Err(bastile::BastileError::Shape(format!(
                "labels are [{lb}, {ls}] but input ids are [{b}, {s}]"
            ))
            .into());
        }
        if s < 2 {
            return Err(bastile::BastileError::Shape(format!(
                "a shifted loss needs rows of at least 2 positions (a token and the one it \
                 predicts), got [{b}, {s}]"
            ))
            .into());
        }
        let ids = if options.defer_label_check {
            ids.clamp(0, self.config.vocab_size as i64 - 1)
        } else {
            self.check_token_ids(&ids).result()?;
            ids
        };
        let labels = match &positions {
            Some(p) => packed_labels(labels, p.clone(), options.ignore_index),
            None => labels,
        };
        let shifted = Tensor::cat(
            vec![
                labels.clone().narrow(1, 1, s - 1),
                Tensor::full([b, 1], options.ignore_index, &labels.device()),
            ],
            1,
        );
        Ok(LossInput {
            ids,
            shifted,
            positions,
        })
    }

    /// The loss of the final hidden states `x` (`[batch, seq, hidden]`,
    /// before the final norm) against `shifted` labels.
    pub(crate) fn head_loss(
        &self,
        x: Tensor<B, 3>,
        shifted: Tensor<B, 2, Int>,
        options: CrossEntropyOptions,
    ) -> Result<CrossEntropyOutput<B>, ModelError> {
        let [b, s, h] = x.dims();
        let x = self.model.norm.try_forward(x)?;
        Ok(linear_cross_entropy(
            x.reshape([b * s, h]),
            self.head_weight(),
            None,
            shifted.reshape([b * s]),
            options,
        )?)
    }
}

/// What [`CausalLm::loss_input`] makes of a batch.
pub(crate) struct LossInput<B: Backend> {
    /// `[batch, seq]` ids inside the vocabulary.
    pub(crate) ids: Tensor<B, 2, Int>,
    /// `[batch, seq]`: the label each position predicts (the next one's),
    /// the ignore index where none counts.
    pub(crate) shifted: Tensor<B, 2, Int>,
    pub(crate) positions: Option<Tensor<B, 2, Int>>,
}

impl<B: BastileBackend> Layer<B> {
    /// `x` `[batch, seq, hidden]` → `[batch, seq, hidden]`: attention and
    /// the MLP, each behind its norm and added to the residual stream; with
    /// `router_load`, the experts' [`RouterLoad`] (none for a dense MLP).
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        tables: &RopeTables<B>,
        positions: Option<&Tensor<B, 2, Int>>,
        router_load: bool,
    ) -> Result<(Tensor<B, 3>, Option<RouterLoad<B>>), ModelError> {
        let adapters = self.lora.as_ref();
        let a = self.self_attn.forward(
            self.input_layernorm.try_forward(x.clone())?,
            tables,
            positions,
            adapters.map(|l| &l.self_attn),
        )?;
        let x = x + a;
        let (m, load) = self.mlp.forward(
            self.post_attention_layernorm.try_forward(x.clone())?,
            adapters.map(|l| &l.mlp),
            router_load,
        )?;
        Ok((x + m, load))
    }
}

/// `labels` (`[batch, seq]`, unshifted) of rows packing several
/// documents, with `ignore_index` where a document starts (`positions`
/// 0): the shifted loss then never trains a document's last token to
/// predict the next document's first.
pub fn packed_labels<B: Backend>(
    labels: Tensor<B, 2, Int>,
    positions: Tensor<B, 2, Int>,
    ignore_index: i64,
) -> Tensor<B, 2, Int> {
    labels.mask_fill(positions.equal_elem(0), ignore_index)
}

/// Casts every float parameter, keeping its id and whether it trains.
pub(crate) struct CastParams(pub(crate) DType);

impl<B: Backend> ModuleMapper<B> for CastParams {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let trains = tensor.is_require_grad();
        let cast = tensor.cast(self.0).detach();
        let cast = if trains { cast.require_grad() } else { cast };
        Param::from_mapped_value(id, cast, mapper)
    }
}
