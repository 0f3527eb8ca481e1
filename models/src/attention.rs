//! Grouped-query causal self-attention: optional per-head q/k RMSNorm
//! (Qwen3), biases and attention sinks plus a sliding window (GPT-OSS).
//! RoPE and the attention itself go through Bastile's ops (fused kernels
//! under `Bastile<B>`, Burn's ops otherwise).

use bastile::nn::{RmsNorm, RmsNormConfig};
use bastile::{
    AttentionOptions, BastileBackend, RopeLayout, RopeOptions, RopeTables, attention, rope,
};
use burn::module::{Module, Param};
use burn::nn::{Initializer, Linear, LinearConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

use crate::ModelError;
use crate::config::ModelConfig;
use crate::lora::{AttentionAdapters, LoraAdapter, project};

/// HF names: `q_proj`, `k_proj`, `v_proj`, `o_proj`, `q_norm`, `k_norm`,
/// `sinks`.
#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    pub q_proj: Linear<B>,
    pub k_proj: Linear<B>,
    pub v_proj: Linear<B>,
    pub o_proj: Linear<B>,
    pub q_norm: Option<RmsNorm<B>>,
    pub k_norm: Option<RmsNorm<B>>,
    pub sinks: Option<Param<Tensor<B, 1>>>,
    #[module(skip)]
    pub heads: usize,
    #[module(skip)]
    pub kv_heads: usize,
    #[module(skip)]
    pub head_dim: usize,
    #[module(skip)]
    pub window: Option<usize>,
    /// Other layers of the model have a sliding window: this layer, if it
    /// has none, runs the windowed kernels with a window as long as the
    /// sequence (which masks nothing), so that the model compiles one
    /// attention kernel per pass instead of two.
    #[module(skip)]
    pub windows_elsewhere: bool,
}

impl<B: Backend> Attention<B> {
    pub fn new(config: &ModelConfig, layer: usize, device: &B::Device) -> Self {
        let (h, d) = (config.hidden_size, config.head_dim);
        let linear = |i, o| {
            LinearConfig::new(i, o)
                .with_bias(config.attention_bias)
                .init(device)
        };
        let norm = || {
            config.qk_norm.then(|| {
                RmsNormConfig::new(d)
                    .with_epsilon(config.rms_norm_eps)
                    .with_cast(config.norm_cast)
                    .init(device)
            })
        };
        Attention {
            q_proj: linear(h, config.heads * d),
            k_proj: linear(h, config.kv_heads * d),
            v_proj: linear(h, config.kv_heads * d),
            o_proj: linear(config.heads * d, h),
            q_norm: norm(),
            k_norm: norm(),
            sinks: config
                .attention_sinks
                .then(|| Initializer::Zeros.init([config.heads], device)),
            heads: config.heads,
            kv_heads: config.kv_heads,
            head_dim: d,
            window: config.windows[layer],
            windows_elsewhere: config.windows.iter().any(Option::is_some),
        }
    }
}

impl<B: BastileBackend> Attention<B> {
    /// `x` `[batch, seq, hidden]` → `[batch, seq, hidden]`, with RoPE from
    /// `tables`. With `positions` (`[batch, seq]`, each token's place in
    /// its document), rows pack several documents and each token attends
    /// only to its own document. `adapters` add their LoRA updates to the
    /// projections.
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        tables: &RopeTables<B>,
        positions: Option<&Tensor<B, 2, Int>>,
        adapters: Option<&AttentionAdapters<B>>,
    ) -> Result<Tensor<B, 3>, ModelError> {
        let [b, s, _] = x.dims();
        let (nh, nkv, d) = (self.heads, self.kv_heads, self.head_dim);
        let adapter = |pick: fn(&AttentionAdapters<B>) -> &Option<LoraAdapter<B>>| {
            adapters.and_then(|a| pick(a).as_ref())
        };
        let mut q =
            project(&self.q_proj, adapter(|a| &a.q_proj), x.clone())?.reshape([b, s, nh, d]);
        let mut k =
            project(&self.k_proj, adapter(|a| &a.k_proj), x.clone())?.reshape([b, s, nkv, d]);
        let v = project(&self.v_proj, adapter(|a| &a.v_proj), x)?.reshape([b, s, nkv, d]);
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            q = qn.try_forward(q)?;
            k = kn.try_forward(k)?;
        }
        let sinks = self.sinks.as_ref().map(|s| s.val());
        let out = self.attend(q, k, v, sinks, tables, positions)?;
        project(&self.o_proj, adapter(|a| &a.o_proj), out)
    }

    /// RoPE and attention of projected (and normed) `q`
    /// `[batch, seq, heads, head_dim]`, `k` and `v`
    /// `[batch, seq, kv_heads, head_dim]`, with the layer's `sinks`
    /// (`[heads]`): `[batch, seq, heads · head_dim]`, the output
    /// projection's input.
    pub fn attend(
        &self,
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        sinks: Option<Tensor<B, 1>>,
        tables: &RopeTables<B>,
        positions: Option<&Tensor<B, 2, Int>>,
    ) -> Result<Tensor<B, 3>, ModelError> {
        let options = RopeOptions {
            layout: RopeLayout::Bshd,
            ..Default::default()
        };
        let (q, k) = rope(q, k, tables, options)?;
        self.attend_rotated(q, k, v, sinks, positions)
    }

    /// [`Attention::attend`] of `q` and `k` that RoPE has rotated already.
    pub fn attend_rotated(
        &self,
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        sinks: Option<Tensor<B, 1>>,
        positions: Option<&Tensor<B, 2, Int>>,
    ) -> Result<Tensor<B, 3>, ModelError> {
        let [b, s, nh, d] = q.dims();
        // Heads-major views of the projections, read in place; GQA, the
        // causal mask, the window and the sinks are the attention op's.
        let options = AttentionOptions {
            scale: None,
            causal: true,
            window: self
                .window
                .or_else(|| self.windows_elsewhere.then_some(s.max(1))),
        };
        let out = attention(
            q.swap_dims(1, 2),
            k.swap_dims(1, 2),
            v.swap_dims(1, 2),
            sinks,
            None,
            positions.cloned(),
            options,
        )?;
        Ok(out.swap_dims(1, 2).reshape([b, s, nh * d]))
    }
}
