//! Grouped-query causal self-attention with Burn's own ops: optional
//! per-head q/k RMSNorm (Qwen3), biases and attention sinks plus a sliding
//! window (GPT-OSS). RoPE goes through Bastile's fused op.

use bastile::nn::{RmsNorm, RmsNormConfig};
use bastile::{BastileBackend, RopeLayout, RopeOptions, RopeTables, rope};
use burn::module::{Module, Param};
use burn::nn::{Initializer, Linear, LinearConfig};
use burn::tensor::activation::softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, DType, Int, Tensor};

use crate::ModelError;
use crate::config::ModelConfig;

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
        }
    }
}

/// `[seq, seq]`, `true` where position `k` may not be attended from
/// position `q`: the future, and with a window `w` everything `w` or more
/// positions back. Built once per forward for each distinct window (see
/// [`Attention::window`]) and shared by the layers that use it.
pub fn attention_mask<B: Backend>(
    seq: usize,
    window: Option<usize>,
    device: &B::Device,
) -> Tensor<B, 2, Bool> {
    let pos = Tensor::<B, 1, Int>::arange(0..seq as i64, device);
    let q = pos.clone().reshape([seq, 1]);
    let k = pos.reshape([1, seq]);
    let future = k.clone().greater(q.clone());
    match window {
        Some(w) => future.bool_or(k.lower_equal(q.sub_scalar(w as i64))),
        None => future,
    }
}

impl<B: BastileBackend> Attention<B> {
    /// `x` `[batch, seq, hidden]` → `[batch, seq, hidden]`; `mask` is
    /// [`attention_mask`] for this layer's window.
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        tables: &RopeTables<B>,
        mask: &Tensor<B, 2, Bool>,
    ) -> Result<Tensor<B, 3>, ModelError> {
        let [b, s, _] = x.dims();
        let (nh, nkv, d) = (self.heads, self.kv_heads, self.head_dim);
        let mut q = self.q_proj.forward(x.clone()).reshape([b, s, nh, d]);
        let mut k = self.k_proj.forward(x.clone()).reshape([b, s, nkv, d]);
        let v = self.v_proj.forward(x).reshape([b, s, nkv, d]);
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            q = qn.try_forward(q)?;
            k = kn.try_forward(k)?;
        }
        let options = RopeOptions {
            layout: RopeLayout::Bshd,
            ..Default::default()
        };
        let (q, k) = rope(q, k, tables, options)?;
        let q = q.swap_dims(1, 2);
        let rep = nh / nkv;
        let expand = |t: Tensor<B, 4>| {
            t.swap_dims(1, 2)
                .unsqueeze_dim::<5>(2)
                .expand([b, nkv, rep, s, d])
                .reshape([b, nh, s, d])
        };
        let (k, v) = (expand(k), expand(v));
        let dtype = q.dtype();
        let scale = (d as f64).powf(-0.5);
        // Scores and softmax in f32, as HF's eager attention does.
        let scores = q.matmul(k.swap_dims(2, 3)).cast(DType::F32) * scale;
        let mask = mask.clone().unsqueeze::<4>().expand([b, nh, s, s]);
        let scores = scores.mask_fill(mask, f32::NEG_INFINITY);
        let probs = match &self.sinks {
            // A sink is one more logit per head in the softmax, dropped
            // after it.
            Some(sinks) => {
                let sink = sinks
                    .val()
                    .cast(DType::F32)
                    .reshape([1, nh, 1, 1])
                    .expand([b, nh, s, 1]);
                softmax(Tensor::cat(vec![scores, sink], 3), 3).narrow(3, 0, s)
            }
            None => softmax(scores, 3),
        };
        let out = probs.cast(dtype).matmul(v);
        Ok(self
            .o_proj
            .forward(out.swap_dims(1, 2).reshape([b, s, nh * d])))
    }
}
