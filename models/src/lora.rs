//! LoRA: low-rank adapters on the linear layers of a frozen model, in
//! PEFT's format.
//!
//! [`CausalLm::with_lora`] freezes every parameter of the model (no
//! gradient, so no gradient buffer and no optimizer state) and gives each
//! chosen projection of each layer an adapter: `y = x·W + s·(drop(x)·A)·B`
//! with `A` `[in, rank]` (Kaiming-uniform, as PEFT initializes it), `B`
//! `[rank, out]` (zeros, so training starts from the base model) and
//! `s = alpha / rank` (or `alpha / √rank` with rsLoRA). A projection with
//! its adapter is one autodiff node under `Bastile`
//! ([`bastile::lora_linear`]: the update added into the base product in
//! the GEMM's epilogue); the products run in the activations' dtype (the
//! adapters are cast to it, as autocast does), so bf16 activations meet
//! f32 adapters at bf16 speed while the optimizer keeps the adapters in
//! f32.
//!
//! [`CausalLm::save_adapter_dir`] writes `adapter_config.json` and
//! `adapter_model.safetensors` with PEFT's names
//! (`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`,
//! `[rank, in]`), which `PeftModel.from_pretrained` loads;
//! [`CausalLm::load_adapter_dir`] reads the same from PEFT.
//! [`CausalLm::merge_lora`] folds the adapters into the base weights for an
//! HF export.

use std::collections::BTreeSet;
use std::path::Path;

use burn::module::{Module, Param, ParamId};
use burn::nn::{Dropout, DropoutConfig, Linear, LinearConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use burn_store::{BurnToPyTorchAdapter, ModuleSnapshot, PyTorchToBurnAdapter, SafetensorsStore};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use bastile::{BastileBackend, lora_linear, lora_update};

use crate::hf::{check_header, load_file_into, report_problems};
use crate::model::{CastParams, CausalLm};
use crate::{Architecture, ModelError};

/// A projection an adapter can sit on, by its HF name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LoraTarget {
    Query,
    Key,
    Value,
    Output,
    Gate,
    Up,
    Down,
}

impl LoraTarget {
    /// Every target, in layer order.
    pub const ALL: [LoraTarget; 7] = [
        LoraTarget::Query,
        LoraTarget::Key,
        LoraTarget::Value,
        LoraTarget::Output,
        LoraTarget::Gate,
        LoraTarget::Up,
        LoraTarget::Down,
    ];

    /// The module's HF (and PEFT `target_modules`) name.
    pub fn hf_name(self) -> &'static str {
        match self {
            LoraTarget::Query => "q_proj",
            LoraTarget::Key => "k_proj",
            LoraTarget::Value => "v_proj",
            LoraTarget::Output => "o_proj",
            LoraTarget::Gate => "gate_proj",
            LoraTarget::Up => "up_proj",
            LoraTarget::Down => "down_proj",
        }
    }

    /// A target from its HF name or its short form (`q`, `k`, `v`, `o`,
    /// `gate`, `up`, `down`).
    pub fn parse(name: &str) -> Result<Self, ModelError> {
        let name = name.trim();
        Self::ALL
            .into_iter()
            .find(|t| t.hf_name() == name || t.hf_name().strip_suffix("_proj") == Some(name))
            .ok_or_else(|| {
                ModelError::Config(format!(
                    "`{name}` is not a LoRA target; the targets are {}",
                    Self::ALL.map(|t| t.hf_name()).join(", ")
                ))
            })
    }

    /// Whether the target is one of the dense MLP's projections (GPT-OSS's
    /// experts have none).
    fn in_dense_mlp(self) -> bool {
        matches!(self, LoraTarget::Gate | LoraTarget::Up | LoraTarget::Down)
    }
}

/// Parses a comma-separated target list (`q,k,v,o` or `q_proj,v_proj`);
/// `all` is every projection of the model's layers.
pub fn parse_targets(list: &str) -> Result<Vec<LoraTarget>, ModelError> {
    if list.trim() == "all" || list.trim() == "all-linear" {
        return Ok(LoraTarget::ALL.to_vec());
    }
    targets_named(list.split(','))
}

/// The targets of `names`, each once, in layer order.
fn targets_named<'a>(
    names: impl IntoIterator<Item = &'a str>,
) -> Result<Vec<LoraTarget>, ModelError> {
    let targets: BTreeSet<LoraTarget> = names
        .into_iter()
        .map(LoraTarget::parse)
        .collect::<Result<_, _>>()?;
    Ok(targets.into_iter().collect())
}

/// What adapters to add and how they scale (PEFT's `adapter_config.json`
/// on disk).
#[derive(Clone, Debug, PartialEq)]
pub struct LoraConfig {
    /// The adapters' rank `r` (≥ 1).
    pub rank: usize,
    /// PEFT's `lora_alpha`: the update is scaled by `alpha / rank`.
    pub alpha: f64,
    /// Dropout on the adapter's input while training, in `[0, 1)`.
    pub dropout: f64,
    /// rsLoRA: scale by `alpha / √rank` instead.
    pub rslora: bool,
    /// The projections that get an adapter, in every layer.
    pub targets: Vec<LoraTarget>,
    /// The adapters' dtype (f32 by default, as PEFT keeps them).
    pub dtype: DType,
    /// The base model the adapters belong to (PEFT's
    /// `base_model_name_or_path`: a directory or a preset name), if known.
    pub base_model: Option<String>,
}

impl LoraConfig {
    /// Rank `rank` on every projection, `alpha = rank` (scale 1), no
    /// dropout, f32 adapters.
    pub fn new(rank: usize) -> Self {
        Self {
            rank,
            alpha: rank as f64,
            dropout: 0.0,
            rslora: false,
            targets: LoraTarget::ALL.to_vec(),
            dtype: DType::F32,
            base_model: None,
        }
    }

    pub fn with_alpha(mut self, alpha: f64) -> Self {
        self.alpha = alpha;
        self
    }

    pub fn with_dropout(mut self, dropout: f64) -> Self {
        self.dropout = dropout;
        self
    }

    pub fn with_rslora(mut self, rslora: bool) -> Self {
        self.rslora = rslora;
        self
    }

    pub fn with_targets(mut self, targets: Vec<LoraTarget>) -> Self {
        self.targets = targets;
        self
    }

    pub fn with_dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }

    pub fn with_base_model(mut self, base_model: Option<String>) -> Self {
        self.base_model = base_model;
        self
    }

    /// The factor of the low-rank update.
    pub fn scale(&self) -> f64 {
        if self.rslora {
            self.alpha / (self.rank as f64).sqrt()
        } else {
            self.alpha / self.rank as f64
        }
    }

    /// The config's own consistency, and that every target exists in
    /// `architecture`'s layers.
    fn validate(&self, architecture: Architecture, dense_mlp: bool) -> Result<(), ModelError> {
        let bad = |m: String| Err(ModelError::Config(m));
        if self.rank == 0 {
            return bad("a LoRA rank must be at least 1, got 0".into());
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return bad(format!("LoRA alpha must be positive, got {}", self.alpha));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return bad(format!(
                "LoRA dropout must lie in [0, 1), got {}",
                self.dropout
            ));
        }
        if self.targets.is_empty() {
            return bad("LoRA needs at least one target projection".into());
        }
        if !self.dtype.is_float() {
            return bad(format!(
                "LoRA adapters must be floating point, got {:?}",
                self.dtype
            ));
        }
        if let Some(t) = self.targets.iter().find(|t| t.in_dense_mlp() && !dense_mlp) {
            return bad(format!(
                "{architecture:?} has no `{}` projection (its feed-forward layers are \
                 experts); choose among q_proj, k_proj, v_proj, o_proj",
                t.hf_name()
            ));
        }
        Ok(())
    }

    fn has(&self, target: LoraTarget) -> bool {
        self.targets.contains(&target)
    }
}

/// One projection's adapter: `s · dropout(x) · A · B`.
#[derive(Module, Debug)]
pub struct LoraAdapter<B: Backend> {
    /// `A`, `[in, rank]` (PEFT's `lora_A.weight` is its transpose).
    pub lora_a: Linear<B>,
    /// `B`, `[rank, out]`.
    pub lora_b: Linear<B>,
    pub dropout: Dropout,
    #[module(skip)]
    pub scale: f64,
}

impl<B: Backend> LoraAdapter<B> {
    /// An adapter from `input` to `output` features: `A` Kaiming-uniform
    /// (bound `1/√input`, PEFT's default), `B` zeros; `path` (the module
    /// path of the adapter) decides the parameters' ids, so that the same
    /// adapters get the same ids in every process and an optimizer state
    /// saved beside them applies to them again.
    pub fn new(
        input: usize,
        output: usize,
        config: &LoraConfig,
        path: &str,
        device: &B::Device,
    ) -> Self {
        let placed = |l: Linear<B>, name: &str| Linear {
            weight: Param::initialized(
                ParamId::from(path_hash(&format!("{path}.{name}.weight"))),
                l.weight.val().cast(config.dtype).detach().require_grad(),
            ),
            bias: None,
        };
        Self {
            lora_a: placed(
                LinearConfig::new(input, config.rank)
                    .with_bias(false)
                    .init(device),
                "lora_a",
            ),
            lora_b: placed(
                LinearConfig::new(config.rank, output)
                    .with_bias(false)
                    .with_initializer(burn::nn::Initializer::Zeros)
                    .init(device),
                "lora_b",
            ),
            dropout: DropoutConfig::new(config.dropout).init(),
            scale: config.scale(),
        }
    }

    /// `s · A · B` `[in, out]`: what merging adds to the base weight.
    pub fn delta_weight(&self) -> Tensor<B, 2> {
        self.lora_a
            .weight
            .val()
            .matmul(self.lora_b.weight.val())
            .mul_scalar(self.scale)
    }
}

impl<B: BastileBackend> LoraAdapter<B> {
    /// The update `s · dropout(x) · A · B` of `x`, in `x`'s dtype (the
    /// adapters are cast to it): Bastile's fused LoRA node under
    /// `Bastile`, Burn's ops otherwise.
    ///
    /// # Shapes
    ///
    /// - `x`: `[..., in]`
    /// - output: `[..., out]`
    pub fn update<const D: usize>(&self, x: Tensor<B, D>) -> Result<Tensor<B, D>, ModelError> {
        Ok(lora_update(
            self.dropout.forward(x),
            self.lora_a.weight.val(),
            self.lora_b.weight.val(),
            self.scale,
        )?)
    }
}

/// `linear(x)` plus its adapter's update, if it has one: one fused node
/// under `Bastile` ([`bastile::linear`], [`bastile::lora_linear`]), unless
/// dropout on the adapter's path gives the adapter another input than the
/// base layer's.
///
/// # Shapes
///
/// - `x`: `[..., in]`
/// - output: `[..., out]`
pub fn project<B: BastileBackend, const D: usize>(
    linear: &Linear<B>,
    adapter: Option<&LoraAdapter<B>>,
    x: Tensor<B, D>,
) -> Result<Tensor<B, D>, ModelError> {
    let bias = || linear.bias.as_ref().map(|b| b.val());
    let Some(adapter) = adapter else {
        return Ok(bastile::linear(x, linear.weight.val(), bias())?);
    };
    // What `Dropout::forward` tests: whether it changes its input.
    if adapter.dropout.prob > 0.0 && B::ad_enabled(&x.device()) {
        return Ok(linear.forward(x.clone()) + adapter.update(x)?);
    }
    Ok(lora_linear(
        x,
        linear.weight.val(),
        bias(),
        adapter.lora_a.weight.val(),
        adapter.lora_b.weight.val(),
        adapter.scale,
    )?)
}

/// The adapters of a layer's attention projections (PEFT's paths
/// `self_attn.{q,k,v,o}_proj`).
#[derive(Module, Debug)]
pub struct AttentionAdapters<B: Backend> {
    pub q_proj: Option<LoraAdapter<B>>,
    pub k_proj: Option<LoraAdapter<B>>,
    pub v_proj: Option<LoraAdapter<B>>,
    pub o_proj: Option<LoraAdapter<B>>,
}

/// The adapters of a layer's dense MLP (`mlp.{gate,up,down}_proj`).
#[derive(Module, Debug)]
pub struct MlpAdapters<B: Backend> {
    pub gate_proj: Option<LoraAdapter<B>>,
    pub up_proj: Option<LoraAdapter<B>>,
    pub down_proj: Option<LoraAdapter<B>>,
}

/// A layer's adapters, named as the layer names what they adapt.
#[derive(Module, Debug)]
pub struct LayerAdapters<B: Backend> {
    pub self_attn: AttentionAdapters<B>,
    pub mlp: MlpAdapters<B>,
}

/// PEFT's names, from the layer's `lora` subtree to the model's:
/// `model.layers.N.lora.self_attn.q_proj.lora_a.weight` ↔
/// `base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`.
const BURN_TO_PEFT: [(&str, &str); 2] = [
    (
        r"^model\.layers\.(\d+)\.lora\.(\w+)\.(\w+)\.lora_a\.weight$",
        "base_model.model.model.layers.${1}.${2}.${3}.lora_A.weight",
    ),
    (
        r"^model\.layers\.(\d+)\.lora\.(\w+)\.(\w+)\.lora_b\.weight$",
        "base_model.model.model.layers.${1}.${2}.${3}.lora_B.weight",
    ),
];
const PEFT_TO_BURN: [(&str, &str); 2] = [
    (
        r"^base_model\.model\.model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_A\.weight$",
        "model.layers.${1}.lora.${2}.${3}.lora_a.weight",
    ),
    (
        r"^base_model\.model\.model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_B\.weight$",
        "model.layers.${1}.lora.${2}.${3}.lora_b.weight",
    ),
];
/// The adapter tensors of the module tree.
const ADAPTER_PATHS: &str = r"^model\.layers\.\d+\.lora\.";
/// The PEFT config file of an adapter directory.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";

/// `adapter_config.json` as PEFT writes and reads it (the fields Bastile
/// acts on; PEFT fills the others with its defaults).
#[derive(Serialize, Deserialize)]
struct PeftConfig {
    peft_type: String,
    #[serde(default)]
    task_type: Option<String>,
    r: usize,
    lora_alpha: f64,
    #[serde(default)]
    lora_dropout: f64,
    #[serde(default)]
    use_rslora: bool,
    target_modules: Value,
    #[serde(default = "no_bias")]
    bias: String,
    #[serde(default)]
    fan_in_fan_out: bool,
    #[serde(default)]
    use_dora: bool,
    #[serde(default)]
    modules_to_save: Option<Value>,
    #[serde(default)]
    layers_to_transform: Option<Value>,
    #[serde(default)]
    rank_pattern: Option<Value>,
    #[serde(default)]
    alpha_pattern: Option<Value>,
    #[serde(default)]
    lora_bias: bool,
    #[serde(default)]
    exclude_modules: Option<Value>,
    #[serde(default)]
    target_parameters: Option<Value>,
    #[serde(default)]
    layer_replication: Option<Value>,
    #[serde(default)]
    trainable_token_indices: Option<Value>,
    #[serde(default)]
    base_model_name_or_path: Option<String>,
    #[serde(default)]
    inference_mode: bool,
}

fn no_bias() -> String {
    "none".into()
}

impl PeftConfig {
    fn of(config: &LoraConfig) -> Self {
        Self {
            peft_type: "LORA".into(),
            task_type: Some("CAUSAL_LM".into()),
            r: config.rank,
            lora_alpha: config.alpha,
            lora_dropout: config.dropout,
            use_rslora: config.rslora,
            target_modules: Value::from(
                config
                    .targets
                    .iter()
                    .map(|t| t.hf_name())
                    .collect::<Vec<_>>(),
            ),
            bias: no_bias(),
            fan_in_fan_out: false,
            use_dora: false,
            modules_to_save: None,
            layers_to_transform: None,
            // PEFT reads these as dictionaries: empty, not null.
            rank_pattern: Some(Value::Object(Default::default())),
            alpha_pattern: Some(Value::Object(Default::default())),
            lora_bias: false,
            exclude_modules: None,
            target_parameters: None,
            layer_replication: None,
            trainable_token_indices: None,
            base_model_name_or_path: config.base_model.clone(),
            inference_mode: true,
        }
    }

    /// The LoRA config it describes, or an error naming what Bastile does
    /// not support.
    fn lora(&self, path: &Path) -> Result<LoraConfig, ModelError> {
        let unsupported = |what: &str| {
            Err(ModelError::Config(format!(
                "{}: {what} is not supported",
                path.display()
            )))
        };
        if self.peft_type != "LORA" {
            return unsupported(&format!("PEFT type `{}` (only LORA)", self.peft_type));
        }
        if self.use_dora {
            return unsupported("DoRA (`use_dora`)");
        }
        if self.fan_in_fan_out {
            return unsupported("`fan_in_fan_out`");
        }
        if self.bias != "none" || self.lora_bias {
            return unsupported(&format!(
                "training biases (`bias` \"{}\", `lora_bias` {}; only \"none\" and false)",
                self.bias, self.lora_bias
            ));
        }
        let set = |v: &Option<Value>| {
            v.as_ref().is_some_and(|v| match v {
                Value::Null => false,
                Value::Object(m) => !m.is_empty(),
                Value::Array(a) => !a.is_empty(),
                _ => true,
            })
        };
        for (name, value) in [
            ("`modules_to_save`", &self.modules_to_save),
            ("`layers_to_transform`", &self.layers_to_transform),
            ("`rank_pattern`", &self.rank_pattern),
            ("`alpha_pattern`", &self.alpha_pattern),
            ("`exclude_modules`", &self.exclude_modules),
            ("`target_parameters`", &self.target_parameters),
            ("`layer_replication`", &self.layer_replication),
            ("`trainable_token_indices`", &self.trainable_token_indices),
        ] {
            if set(value) {
                return unsupported(name);
            }
        }
        let targets = match &self.target_modules {
            Value::String(s) if s == "all-linear" => LoraTarget::ALL.to_vec(),
            Value::Array(names) => {
                let names = names
                    .iter()
                    .map(|n| {
                        n.as_str().ok_or_else(|| {
                            ModelError::Config(format!(
                                "{}: `target_modules` holds {n}, not a name",
                                path.display()
                            ))
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                targets_named(names)?
            }
            other => {
                return unsupported(&format!(
                    "`target_modules` {other} (a list of names or \"all-linear\")"
                ));
            }
        };
        Ok(LoraConfig {
            rank: self.r,
            alpha: self.lora_alpha,
            dropout: self.lora_dropout,
            rslora: self.use_rslora,
            targets,
            dtype: DType::F32,
            base_model: self.base_model_name_or_path.clone(),
        })
    }
}

impl<B: Backend> CausalLm<B> {
    /// Freezes every parameter of the model and adds `config`'s adapters
    /// to each layer (see the [module](self) docs). Errors on a rank of 0,
    /// an alpha that is not positive, a dropout outside `[0, 1)`, no
    /// targets, a target the architecture does not have, or a model that
    /// already has adapters.
    pub fn with_lora(self, config: LoraConfig, device: &B::Device) -> Result<Self, ModelError> {
        let dense = self.config.moe.is_none();
        config.validate(self.config.architecture, dense)?;
        if self.lora.is_some() {
            return Err(ModelError::Config(
                "the model already has LoRA adapters (merge them first)".into(),
            ));
        }
        let c = &self.config;
        let (h, q, kv, inter) = (
            c.hidden_size,
            c.heads * c.head_dim,
            c.kv_heads * c.head_dim,
            c.intermediate_size,
        );
        let mut model = self.no_grad();
        for (n, layer) in model.model.layers.iter_mut().enumerate() {
            let adapter = |t: LoraTarget, i, o| {
                let block = if t.in_dense_mlp() { "mlp" } else { "self_attn" };
                let path = format!("model.layers.{n}.lora.{block}.{}", t.hf_name());
                config
                    .has(t)
                    .then(|| LoraAdapter::new(i, o, &config, &path, device))
            };
            layer.lora = Some(LayerAdapters {
                self_attn: AttentionAdapters {
                    q_proj: adapter(LoraTarget::Query, h, q),
                    k_proj: adapter(LoraTarget::Key, h, kv),
                    v_proj: adapter(LoraTarget::Value, h, kv),
                    o_proj: adapter(LoraTarget::Output, q, h),
                },
                mlp: MlpAdapters {
                    gate_proj: adapter(LoraTarget::Gate, h, inter),
                    up_proj: adapter(LoraTarget::Up, h, inter),
                    down_proj: adapter(LoraTarget::Down, inter, h),
                },
            });
        }
        model.lora = Some(config);
        model.check_checkpointing()?;
        Ok(model)
    }

    /// The model with each adapter folded into its base weight
    /// (`W + s·A·B`, in `W`'s dtype) and the adapters removed: the same
    /// outputs (without dropout), for an HF export. The base weights stay
    /// frozen. A model without adapters comes back as it is.
    pub fn merge_lora(mut self) -> Self {
        self.lora = None;
        for layer in &mut self.model.layers {
            let Some(adapters) = layer.lora.take() else {
                continue;
            };
            let attn = &mut layer.self_attn;
            let a = adapters.self_attn;
            merge(&mut attn.q_proj, a.q_proj);
            merge(&mut attn.k_proj, a.k_proj);
            merge(&mut attn.v_proj, a.v_proj);
            merge(&mut attn.o_proj, a.o_proj);
            if let crate::mlp::Mlp::Dense(mlp) = &mut layer.mlp {
                let a = adapters.mlp;
                merge(&mut mlp.gate_proj, a.gate_proj);
                merge(&mut mlp.up_proj, a.up_proj);
                merge(&mut mlp.down_proj, a.down_proj);
            }
        }
        self
    }

    /// The LoRA config of the model's adapters, if it has them.
    pub fn lora_config(&self) -> Option<&LoraConfig> {
        self.lora.as_ref()
    }

    /// Writes the adapters in PEFT's format into `dir` (created if
    /// needed): `adapter_config.json` and `adapter_model.safetensors`
    /// (the adapters' dtype), which `PeftModel.from_pretrained(base, dir)`
    /// loads. An error when the model has no adapters.
    pub fn save_adapter_dir(&self, dir: impl AsRef<Path>) -> Result<(), ModelError> {
        let dir = dir.as_ref();
        let config = self
            .lora
            .as_ref()
            .ok_or_else(|| ModelError::Config("the model has no LoRA adapters to save".into()))?;
        std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
        let config_path = dir.join(ADAPTER_CONFIG);
        let text =
            serde_json::to_string_pretty(&PeftConfig::of(config)).expect("a config serializes");
        std::fs::write(&config_path, text).map_err(|e| ModelError::io(&config_path, e))?;
        let file = dir.join(ADAPTER_WEIGHTS);
        let mut store = SafetensorsStore::from_file(&file)
            .with_to_adapter(BurnToPyTorchAdapter)
            .with_regex(ADAPTER_PATHS)
            .skip_enum_variants(true)
            .overwrite(true)
            .metadata("format", "pt");
        for (from, to) in BURN_TO_PEFT {
            store = store.with_key_remapping(from, to);
        }
        self.save_into(&mut store)
            .map_err(|e| ModelError::Safetensors {
                path: file.clone(),
                message: e.to_string(),
            })
    }

    /// Adds the adapters of a PEFT adapter directory (`adapter_config.json`
    /// and `adapter_model.safetensors`, as PEFT or
    /// [`CausalLm::save_adapter_dir`] writes them) to the model, freezing
    /// it as [`CausalLm::with_lora`] does; the adapters keep the file's
    /// dtype unless `dtype` names one. Errors on what Bastile does not
    /// support (DoRA, bias training, per-layer ranks, `modules_to_save`),
    /// and on an adapter that does not fit the model: a tensor whose shape
    /// differs (another base model), a missing or an unexpected one (all
    /// named).
    pub fn load_adapter_dir(
        self,
        dir: impl AsRef<Path>,
        dtype: Option<DType>,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let dir = dir.as_ref();
        let config = read_adapter_config(dir)?;
        let file = dir.join(ADAPTER_WEIGHTS);
        check_header(&file)?;
        let mut model = self.with_lora(config, device)?;
        let mut store = SafetensorsStore::from_file(&file)
            .with_from_adapter(PyTorchToBurnAdapter)
            .skip_enum_variants(true)
            .allow_partial(true)
            // Shape mismatches come back in the result, to be reported
            // with PEFT's names.
            .validate(false);
        for (from, to) in PEFT_TO_BURN {
            store = store.with_key_remapping(from, to);
        }
        let result = load_file_into(&mut model, &mut store, &file)?;
        // The base model's tensors are not in the file.
        let missing: Vec<String> = result
            .missing
            .into_iter()
            .map(|(path, _)| path)
            .filter(|p| is_adapter_path(p))
            .collect();
        report_problems(&result.errors, &missing, &result.unused, dir, peft_name)?;
        // Loaded tensors keep the file's dtype; cast them when asked.
        if let Some(dtype) = dtype {
            for layer in &mut model.model.layers {
                layer.lora = layer.lora.take().map(|l| l.map(&mut CastParams(dtype)));
            }
        }
        Ok(model)
    }
}

/// The LoRA config of a PEFT adapter directory (its `adapter_config.json`,
/// base model included); an error names what Bastile does not support.
pub fn read_adapter_config(dir: &Path) -> Result<LoraConfig, ModelError> {
    let path = dir.join(ADAPTER_CONFIG);
    crate::error::read_json::<PeftConfig>(&path)?.lora(&path)
}

/// PEFT's name of an adapter tensor's module path (other paths as they
/// are): `model.layers.N.lora.X.Y.lora_a.weight` →
/// `base_model.model.model.layers.N.X.Y.lora_A.weight`.
fn peft_name(path: &str) -> String {
    let Some((layer, rest)) = path.split_once(".lora.") else {
        return path.into();
    };
    let rest = rest
        .replace(".lora_a.", ".lora_A.")
        .replace(".lora_b.", ".lora_B.");
    format!("base_model.model.{layer}.{rest}")
}

/// A 64-bit FNV-1a hash of a module path: the id of an adapter parameter.
fn path_hash(path: &str) -> u64 {
    path.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Whether a module path is an adapter tensor's.
fn is_adapter_path(path: &str) -> bool {
    path.starts_with("model.layers.") && path.contains(".lora.")
}

/// Folds `adapter` into `linear`'s weight.
fn merge<B: Backend>(linear: &mut Linear<B>, adapter: Option<LoraAdapter<B>>) {
    let Some(adapter) = adapter else { return };
    let delta = adapter.delta_weight();
    let weight = linear.weight.clone();
    linear.weight = weight.map(|w| {
        let dtype = w.dtype();
        (w.cast(delta.dtype()) + delta).cast(dtype).detach()
    });
}
