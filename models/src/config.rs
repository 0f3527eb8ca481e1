//! Model configs: Hugging Face's `config.json` (HF field names, both the
//! `rope_theta` + `rope_scaling` form of published checkpoints and the
//! `rope_parameters` form newer transformers writes) and the resolved,
//! validated [`ModelConfig`] the model is built from.

use std::path::Path;

use bastile::RmsNormCast;
use bastile::nn::RopeScaling;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::ModelError;

/// The architectures this crate builds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Architecture {
    Qwen3,
    Llama,
    GptOss,
}

impl Architecture {
    /// HF's `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Qwen3 => "qwen3",
            Architecture::Llama => "llama",
            Architecture::GptOss => "gpt_oss",
        }
    }

    /// HF's class name, written to `architectures` on save.
    pub fn hf_class(self) -> &'static str {
        match self {
            Architecture::Qwen3 => "Qwen3ForCausalLM",
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::GptOss => "GptOssForCausalLM",
        }
    }
}

/// `config.json` as HF writes it. Fields the models do not use are kept in
/// `extra` so a saved config round-trips.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HfConfig {
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_key_value_heads: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_parameters: Option<Value>,
    #[serde(default = "default_max_positions")]
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_local_experts: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_experts_per_tok: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_types: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub swiglu_limit: Option<f64>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

fn default_eps() -> f64 {
    1e-6
}

fn default_max_positions() -> usize {
    4096
}

/// Mixture-of-experts settings (GPT-OSS).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeConfig {
    pub experts: usize,
    pub top_k: usize,
    /// The GEGLU clamp (`swiglu_limit`, 7.0).
    pub limit: f64,
    /// The coefficient of the router's load-balancing loss added to the
    /// training loss (HF's `router_aux_loss_coef` when `config.json` sets
    /// `output_router_logits`); `None`: no such loss.
    pub router_aux_loss: Option<f64>,
}

/// A validated config: everything the model code needs, in one place.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub norm_cast: RmsNormCast,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub max_positions: usize,
    pub tie_word_embeddings: bool,
    /// Per-head RMSNorm of q and k (Qwen3).
    pub qk_norm: bool,
    pub attention_bias: bool,
    pub mlp_bias: bool,
    /// A learned per-head logit in the attention softmax (GPT-OSS).
    pub attention_sinks: bool,
    /// Per layer: `Some(w)` attends to the last `w` positions only.
    pub windows: Vec<Option<usize>>,
    pub moe: Option<MoeConfig>,
}

impl HfConfig {
    /// Reads and parses `config.json`.
    pub fn from_file(path: &Path) -> Result<Self, ModelError> {
        crate::error::read_json(path)
    }

    /// The architecture named by `model_type`.
    pub fn architecture(&self) -> Result<Architecture, ModelError> {
        match self.model_type.as_str() {
            "qwen3" => Ok(Architecture::Qwen3),
            "llama" => Ok(Architecture::Llama),
            "gpt_oss" => Ok(Architecture::GptOss),
            other => Err(ModelError::Config(format!(
                "unsupported model_type `{other}` (supported: qwen3, llama, gpt_oss)"
            ))),
        }
    }

    /// `(theta, scaling)` from either rope form.
    fn rope(&self) -> Result<(f64, RopeScaling), ModelError> {
        let params = self.rope_parameters.as_ref().and_then(Value::as_object);
        let theta = self
            .rope_theta
            .or_else(|| {
                params
                    .and_then(|p| p.get("rope_theta"))
                    .and_then(Value::as_f64)
            })
            .unwrap_or(10_000.0);
        let scaling = match self.rope_scaling.as_ref().or(self.rope_parameters.as_ref()) {
            None | Some(Value::Null) => RopeScaling::None,
            Some(v) => parse_scaling(v, self.max_position_embeddings)?,
        };
        Ok((theta, scaling))
    }

    /// HF's load-balancing loss setting: `router_aux_loss_coef` (HF's
    /// default 0.001) when `output_router_logits` is true.
    fn router_aux_loss(&self) -> Result<Option<f64>, ModelError> {
        if self
            .extra
            .get("output_router_logits")
            .and_then(Value::as_bool)
            != Some(true)
        {
            return Ok(None);
        }
        let coef = match self.extra.get("router_aux_loss_coef") {
            None | Some(Value::Null) => 0.001,
            Some(v) => v.as_f64().ok_or_else(|| {
                ModelError::Config(format!("router_aux_loss_coef must be a number, got {v}"))
            })?,
        };
        check_router_aux_loss(coef).map(Some)
    }

    /// Validates and resolves the config.
    pub fn resolve(&self) -> Result<ModelConfig, ModelError> {
        let architecture = self.architecture()?;
        let bad = |m: String| Err(ModelError::Config(m));
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
        ] {
            if v == 0 {
                return bad(format!("{name} must be at least 1"));
            }
        }
        let heads = self.num_attention_heads;
        let kv_heads = self.num_key_value_heads.unwrap_or(heads);
        if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return bad(format!(
                "num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
            ));
        }
        let head_dim = match self.head_dim {
            Some(d) => d,
            None if self.hidden_size.is_multiple_of(heads) => self.hidden_size / heads,
            None => {
                return bad(format!(
                    "hidden_size ({}) is not a multiple of num_attention_heads ({heads}) and head_dim is not given",
                    self.hidden_size
                ));
            }
        };
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return bad(format!(
                "head_dim must be even and positive, got {head_dim}"
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return bad(format!(
                "rms_norm_eps must be positive, got {}",
                self.rms_norm_eps
            ));
        }
        if self
            .extra
            .get("use_sliding_window")
            .and_then(Value::as_bool)
            == Some(true)
        {
            return bad(
                "Qwen sliding-window attention (use_sliding_window) is not supported".into(),
            );
        }
        let (rope_theta, rope_scaling) = self.rope()?;
        let layers = self.num_hidden_layers;
        let (windows, moe) = match architecture {
            Architecture::GptOss => {
                let window = self.sliding_window.unwrap_or(128);
                let types = self
                    .layer_types
                    .clone()
                    .unwrap_or_else(|| alternating_layer_types(layers));
                if types.len() != layers {
                    return bad(format!(
                        "layer_types has {} entries for {layers} layers",
                        types.len()
                    ));
                }
                let windows = types
                    .iter()
                    .map(|t| match t.as_str() {
                        "sliding_attention" => Ok(Some(window)),
                        "full_attention" => Ok(None),
                        other => Err(ModelError::Config(format!("unknown layer type `{other}`"))),
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                let experts = self.num_local_experts.unwrap_or(0);
                let top_k = self.num_experts_per_tok.unwrap_or(0);
                if experts == 0 || top_k == 0 || top_k > experts {
                    return bad(format!(
                        "GPT-OSS needs 1 <= num_experts_per_tok ({top_k}) <= num_local_experts ({experts})"
                    ));
                }
                let moe = MoeConfig {
                    experts,
                    top_k,
                    limit: self.swiglu_limit.unwrap_or(7.0),
                    router_aux_loss: self.router_aux_loss()?,
                };
                (windows, Some(moe))
            }
            _ => (vec![None; layers], None),
        };
        Ok(ModelConfig {
            architecture,
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            layers,
            heads,
            kv_heads,
            head_dim,
            rms_norm_eps: self.rms_norm_eps,
            norm_cast: match architecture {
                Architecture::GptOss => RmsNormCast::GptOss,
                _ => RmsNormCast::Llama,
            },
            rope_theta,
            rope_scaling,
            max_positions: self.max_position_embeddings,
            tie_word_embeddings: self.tie_word_embeddings,
            qk_norm: architecture == Architecture::Qwen3,
            // GPT-OSS projections always carry biases.
            attention_bias: self.attention_bias || architecture == Architecture::GptOss,
            mlp_bias: self.mlp_bias,
            attention_sinks: architecture == Architecture::GptOss,
            windows,
            moe,
        })
    }
}

/// `coef` if it can weigh the router's load-balancing loss (finite, not
/// negative).
pub(crate) fn check_router_aux_loss(coef: f64) -> Result<f64, ModelError> {
    if coef.is_finite() && coef >= 0.0 {
        Ok(coef)
    } else {
        Err(ModelError::Config(format!(
            "the router's load-balancing loss coefficient must be finite and not negative, got {coef}"
        )))
    }
}

/// GPT-OSS's default layer pattern: sliding-window attention on even
/// layers, full attention on odd ones.
pub fn alternating_layer_types(layers: usize) -> Vec<String> {
    (0..layers)
        .map(|i| {
            if i % 2 == 0 {
                "sliding_attention"
            } else {
                "full_attention"
            }
            .to_string()
        })
        .collect()
}

/// A rope scaling object (`rope_scaling` or `rope_parameters`).
fn parse_scaling(v: &Value, max_positions: usize) -> Result<RopeScaling, ModelError> {
    let obj = v
        .as_object()
        .ok_or_else(|| ModelError::Config(format!("rope scaling must be an object, got {v}")))?;
    let kind = obj
        .get("rope_type")
        .or_else(|| obj.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let num = |k: &str| obj.get(k).and_then(Value::as_f64);
    let need = |k: &str| {
        num(k).ok_or_else(|| ModelError::Config(format!("{kind} rope scaling needs `{k}`")))
    };
    let original = obj
        .get("original_max_position_embeddings")
        .and_then(Value::as_u64)
        .map(|v| v as usize);
    match kind {
        "default" => Ok(RopeScaling::None),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: need("factor")?,
            low_freq_factor: need("low_freq_factor")?,
            high_freq_factor: need("high_freq_factor")?,
            original_max_position_embeddings: original.ok_or_else(|| {
                ModelError::Config(
                    "llama3 rope scaling needs `original_max_position_embeddings`".into(),
                )
            })?,
        }),
        "yarn" => Ok(RopeScaling::Yarn {
            factor: need("factor")?,
            beta_fast: num("beta_fast").unwrap_or(32.0),
            beta_slow: num("beta_slow").unwrap_or(1.0),
            original_max_position_embeddings: original.unwrap_or(max_positions),
            truncate: obj.get("truncate").and_then(Value::as_bool).unwrap_or(true),
            attention_factor: num("attention_factor"),
            mscale: num("mscale"),
            mscale_all_dim: num("mscale_all_dim"),
        }),
        other => Err(ModelError::Config(format!(
            "unsupported rope type `{other}` (supported: default, llama3, yarn)"
        ))),
    }
}
