//! Named configs of the published models (from their HF `config.json`), so
//! benchmarks and tests build the real sizes without a download.

use serde_json::{Map, Value, json};

use crate::config::alternating_layer_types;
use crate::{HfConfig, ModelError};

/// The preset names [`preset`] knows.
pub const NAMES: &[&str] = &[
    "qwen3-0.6b",
    "qwen3-1.7b",
    "qwen3-4b",
    "qwen3-8b",
    "llama-3.2-1b",
    "llama-3.2-3b",
    "gpt-oss-20b",
    "gpt-oss-20b-4l",
    "gpt-oss-20b-8l",
    "bastile-tiny",
];

/// The vocabulary of [`TINY`]: room for the 256 bytes and the special
/// tokens of the `bastile` command's byte-level tokenizer, rounded up to a
/// multiple of 8.
pub const TINY_VOCAB: usize = 264;

/// A Qwen3-architecture model small enough to train from scratch on a CPU
/// in seconds (about 0.4 M parameters), for the `bastile` command's
/// embedded default and for functional runs on software devices.
pub const TINY: &str = "bastile-tiny";

struct Dense {
    hidden: usize,
    inter: usize,
    layers: usize,
    heads: usize,
    kv: usize,
    head_dim: usize,
    tied: bool,
}

fn qwen3(d: Dense) -> HfConfig {
    base("qwen3", 151936, d, 1e-6, 40960, json!(1_000_000.0), None)
}

fn llama(d: Dense) -> HfConfig {
    let scaling = json!({
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192
    });
    base(
        "llama",
        128256,
        d,
        1e-5,
        131072,
        json!(500_000.0),
        Some(scaling),
    )
}

fn base(
    model_type: &str,
    vocab: usize,
    d: Dense,
    eps: f64,
    max_positions: usize,
    theta: Value,
    scaling: Option<Value>,
) -> HfConfig {
    HfConfig {
        model_type: model_type.into(),
        vocab_size: vocab,
        hidden_size: d.hidden,
        intermediate_size: d.inter,
        num_hidden_layers: d.layers,
        num_attention_heads: d.heads,
        num_key_value_heads: Some(d.kv),
        head_dim: Some(d.head_dim),
        rms_norm_eps: eps,
        rope_theta: theta.as_f64(),
        rope_scaling: scaling,
        rope_parameters: None,
        max_position_embeddings: max_positions,
        tie_word_embeddings: d.tied,
        attention_bias: false,
        mlp_bias: false,
        num_local_experts: None,
        num_experts_per_tok: None,
        sliding_window: None,
        layer_types: None,
        swiglu_limit: None,
        extra: Map::new(),
    }
}

fn gpt_oss(layers: usize) -> HfConfig {
    let d = Dense {
        hidden: 2880,
        inter: 2880,
        layers,
        heads: 64,
        kv: 8,
        head_dim: 64,
        tied: false,
    };
    let scaling = json!({
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 4096, "truncate": false
    });
    let mut c = base(
        "gpt_oss",
        201088,
        d,
        1e-5,
        131072,
        json!(150_000.0),
        Some(scaling),
    );
    c.attention_bias = true;
    c.num_local_experts = Some(32);
    c.num_experts_per_tok = Some(4);
    c.sliding_window = Some(128);
    c.swiglu_limit = Some(7.0);
    c.layer_types = Some(alternating_layer_types(layers));
    c
}

/// The config of a named model (see [`NAMES`]; case-insensitive).
pub fn preset(name: &str) -> Result<HfConfig, ModelError> {
    let d = |hidden, inter, layers, heads, kv, head_dim, tied| Dense {
        hidden,
        inter,
        layers,
        heads,
        kv,
        head_dim,
        tied,
    };
    Ok(match name.to_ascii_lowercase().as_str() {
        "qwen3-0.6b" => qwen3(d(1024, 3072, 28, 16, 8, 128, true)),
        "qwen3-1.7b" => qwen3(d(2048, 6144, 28, 16, 8, 128, true)),
        "qwen3-4b" => qwen3(d(2560, 9728, 36, 32, 8, 128, true)),
        "qwen3-8b" => qwen3(d(4096, 12288, 36, 32, 8, 128, false)),
        "llama-3.2-1b" => llama(d(2048, 8192, 16, 32, 8, 64, true)),
        "llama-3.2-3b" => llama(d(3072, 8192, 28, 24, 8, 128, true)),
        "gpt-oss-20b" => gpt_oss(24),
        "gpt-oss-20b-4l" => gpt_oss(4),
        "gpt-oss-20b-8l" => gpt_oss(8),
        TINY => {
            let mut c = qwen3(d(128, 384, 2, 4, 2, 32, true));
            c.vocab_size = TINY_VOCAB;
            c.max_position_embeddings = 2048;
            c.rope_theta = Some(10_000.0);
            c
        }
        other => {
            return Err(ModelError::Config(format!(
                "unknown preset `{other}` (known: {})",
                NAMES.join(", ")
            )));
        }
    })
}
