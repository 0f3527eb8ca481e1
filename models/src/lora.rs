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
//! GPT-OSS's router and experts take adapters too, as PEFT gives them
//! (`target_parameters`): the router's as a linear layer's, and each
//! expert weight `[experts, in, out]` one adapter per expert, whose update
//! `s·(x·A_e)·B_e` is added to that expert's product (the same output as
//! PEFT's `W_e + s·A_e·B_e`, without the merged weight's size in
//! memory). PEFT refuses dropout on these, and so does Bastile.
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
use burn::nn::{Dropout, DropoutConfig, Initializer, Linear, LinearConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use burn_store::{BurnToPyTorchAdapter, ModuleSnapshot, PyTorchToBurnAdapter, SafetensorsStore};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use bastile::{BastileBackend, lora_linear, lora_update};

use crate::hf::{check_header, load_file_into, report_problems};
use crate::model::{CastParams, CausalLm};
use crate::{Architecture, ModelError};

/// A weight an adapter can sit on: a linear layer (PEFT's
/// `target_modules`) or one of GPT-OSS's router and expert weights
/// (PEFT's `target_parameters`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LoraTarget {
    Query,
    Key,
    Value,
    Output,
    Gate,
    Up,
    Down,
    /// GPT-OSS's router, `[hidden] → [experts]`.
    Router,
    /// GPT-OSS's experts' `gate_up_proj`, `[experts, hidden, 2·inter]`.
    ExpertsGateUp,
    /// GPT-OSS's experts' `down_proj`, `[experts, inter, hidden]`.
    ExpertsDown,
}

impl LoraTarget {
    /// Every target, in layer order.
    pub const ALL: [LoraTarget; 10] = [
        LoraTarget::Query,
        LoraTarget::Key,
        LoraTarget::Value,
        LoraTarget::Output,
        LoraTarget::Gate,
        LoraTarget::Up,
        LoraTarget::Down,
        LoraTarget::Router,
        LoraTarget::ExpertsGateUp,
        LoraTarget::ExpertsDown,
    ];

    /// The linear layers (PEFT's `all-linear`).
    pub const LINEAR: [LoraTarget; 7] = [
        LoraTarget::Query,
        LoraTarget::Key,
        LoraTarget::Value,
        LoraTarget::Output,
        LoraTarget::Gate,
        LoraTarget::Up,
        LoraTarget::Down,
    ];

    /// GPT-OSS's router and expert weights (PEFT's `target_parameters`).
    const PARAMETERS: [LoraTarget; 3] = [
        LoraTarget::Router,
        LoraTarget::ExpertsGateUp,
        LoraTarget::ExpertsDown,
    ];

    /// The HF name PEFT's config gives the target: the module's name in
    /// `target_modules` (`q_proj`), the parameter's path below the layer
    /// in `target_parameters` (`mlp.experts.gate_up_proj`).
    pub fn hf_name(self) -> &'static str {
        match self {
            LoraTarget::Query => "q_proj",
            LoraTarget::Key => "k_proj",
            LoraTarget::Value => "v_proj",
            LoraTarget::Output => "o_proj",
            LoraTarget::Gate => "gate_proj",
            LoraTarget::Up => "up_proj",
            LoraTarget::Down => "down_proj",
            LoraTarget::Router => "mlp.router.weight",
            LoraTarget::ExpertsGateUp => "mlp.experts.gate_up_proj",
            LoraTarget::ExpertsDown => "mlp.experts.down_proj",
        }
    }

    /// Whether PEFT targets it as a parameter (`target_parameters`), not
    /// as a linear layer.
    pub fn is_parameter(self) -> bool {
        Self::PARAMETERS.contains(&self)
    }

    /// The names a target list may give it, the one messages use first:
    /// the HF name and its short form (`q`, `gate`), for GPT-OSS's weights
    /// their paths below the layer and `mlp` and short forms (`router`,
    /// `experts.gate_up`, `experts.down`).
    fn names(self) -> &'static [&'static str] {
        match self {
            LoraTarget::Query => &["q_proj", "q"],
            LoraTarget::Key => &["k_proj", "k"],
            LoraTarget::Value => &["v_proj", "v"],
            LoraTarget::Output => &["o_proj", "o"],
            LoraTarget::Gate => &["gate_proj", "gate"],
            LoraTarget::Up => &["up_proj", "up"],
            LoraTarget::Down => &["down_proj", "down"],
            LoraTarget::Router => &["router", "mlp.router.weight", "router.weight"],
            LoraTarget::ExpertsGateUp => &[
                "experts.gate_up_proj",
                "mlp.experts.gate_up_proj",
                "experts.gate_up",
                "gate_up_proj",
                "gate_up",
            ],
            LoraTarget::ExpertsDown => {
                &["experts.down_proj", "mlp.experts.down_proj", "experts.down"]
            }
        }
    }

    /// The adapter's module path below a layer's `lora` (the projection's
    /// own path in the layer).
    fn module_path(self) -> &'static str {
        match self {
            LoraTarget::Query => "self_attn.q_proj",
            LoraTarget::Key => "self_attn.k_proj",
            LoraTarget::Value => "self_attn.v_proj",
            LoraTarget::Output => "self_attn.o_proj",
            LoraTarget::Gate => "mlp.gate_proj",
            LoraTarget::Up => "mlp.up_proj",
            LoraTarget::Down => "mlp.down_proj",
            LoraTarget::Router => "mlp.router",
            LoraTarget::ExpertsGateUp => "mlp.experts.gate_up_proj",
            LoraTarget::ExpertsDown => "mlp.experts.down_proj",
        }
    }

    /// A target from one of its [names](LoraTarget::hf_name) (`q_proj`,
    /// `q`, `router`, `experts.gate_up_proj`, `experts.down`, …).
    pub fn parse(name: &str) -> Result<Self, ModelError> {
        let name = name.trim();
        Self::ALL
            .into_iter()
            .find(|t| t.names().contains(&name))
            .ok_or_else(|| {
                ModelError::Config(format!(
                    "`{name}` is not a LoRA target; the targets are {}",
                    Self::ALL.map(|t| t.names()[0]).join(", ")
                ))
            })
    }

    /// The linear layer a name in PEFT's `target_modules` names (GPT-OSS's
    /// router and experts are not linear layers there).
    fn parse_linear(name: &str) -> Result<Self, ModelError> {
        let target = Self::parse(name)?;
        if target.is_parameter() {
            return Err(ModelError::Config(format!(
                "`{name}` in `target_modules` is not a linear layer; PEFT adapts GPT-OSS's \
                 router and experts through `target_parameters`"
            )));
        }
        Ok(target)
    }

    /// The target an entry of PEFT's `target_parameters` names: the
    /// parameter's path or any tail of it after a dot (PEFT matches a
    /// parameter whose path ends with the entry), one of GPT-OSS's router
    /// and expert weights.
    fn parse_parameter(entry: &str) -> Result<Self, ModelError> {
        let names_one = |t: &LoraTarget| {
            let path = t.hf_name();
            path == entry || path.ends_with(&format!(".{entry}"))
        };
        match Self::PARAMETERS
            .into_iter()
            .filter(names_one)
            .collect::<Vec<_>>()[..]
        {
            // A bare `weight` would also name every linear layer's weight.
            [target] if entry != "weight" => Ok(target),
            _ => Err(ModelError::Config(format!(
                "`target_parameters` entry `{entry}` is not one of GPT-OSS's router and expert \
                 weights ({}), the parameters Bastile adapts",
                Self::PARAMETERS.map(|t| t.hf_name()).join(", ")
            ))),
        }
    }

    /// Whether a model's layers have the target: the dense MLP's
    /// projections without experts, the router and experts with them.
    fn in_model(self, experts: bool) -> bool {
        match self {
            LoraTarget::Gate | LoraTarget::Up | LoraTarget::Down => !experts,
            t => experts || !t.is_parameter(),
        }
    }
}

/// Parses a comma-separated target list (`q,k,v,o`, `q_proj,v_proj`,
/// `router,experts.gate_up`); `all` is every target the model has, and
/// `all-linear` (PEFT's) every linear layer it has.
pub fn parse_targets(list: &str) -> Result<Vec<LoraTarget>, ModelError> {
    match list.trim() {
        "all" => Ok(LoraTarget::ALL.to_vec()),
        "all-linear" => Ok(LoraTarget::LINEAR.to_vec()),
        _ => targets_named(list.split(','), LoraTarget::parse),
    }
}

/// The targets of `names`, each once, in layer order.
fn targets_named<'a>(
    names: impl IntoIterator<Item = &'a str>,
    parse: fn(&str) -> Result<LoraTarget, ModelError>,
) -> Result<Vec<LoraTarget>, ModelError> {
    let targets: BTreeSet<LoraTarget> = names.into_iter().map(parse).collect::<Result<_, _>>()?;
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
    /// The weights that get an adapter, in every layer. A list holding
    /// every linear layer ([`LoraTarget::LINEAR`], PEFT's `all-linear`)
    /// stands for those the model has (GPT-OSS has no dense MLP), one
    /// holding every target ([`LoraTarget::ALL`]) for every target the
    /// model has; any other target the model lacks is an error.
    pub targets: Vec<LoraTarget>,
    /// The adapters' dtype (f32 by default, as PEFT keeps them).
    pub dtype: DType,
    /// The base model the adapters belong to (PEFT's
    /// `base_model_name_or_path`: a directory or a preset name), if known.
    pub base_model: Option<String>,
}

impl LoraConfig {
    /// Rank `rank` on every target the model has, `alpha = rank` (scale
    /// 1), no dropout, f32 adapters.
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

    /// The config's own consistency, and the targets it gives a model of
    /// `architecture` (with `experts` or a dense MLP): see
    /// [`LoraConfig::targets`].
    fn model_targets(
        &self,
        architecture: Architecture,
        experts: bool,
    ) -> Result<Vec<LoraTarget>, ModelError> {
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
        let named = |set: &[LoraTarget]| set.iter().all(|t| self.targets.contains(t));
        let (all, all_linear) = (named(&LoraTarget::ALL), named(&LoraTarget::LINEAR));
        let mut targets = BTreeSet::new();
        for &t in &self.targets {
            if t.in_model(experts) {
                targets.insert(t);
            } else if !(all || all_linear && !t.is_parameter()) {
                let has = LoraTarget::ALL
                    .into_iter()
                    .filter(|t| t.in_model(experts))
                    .map(|t| t.names()[0])
                    .collect::<Vec<_>>()
                    .join(", ");
                let layers = if experts {
                    "experts"
                } else {
                    "a dense MLP, no router or experts"
                };
                return bad(format!(
                    "{architecture:?} has no `{}` (its feed-forward layers are {layers}); \
                     choose among {has}",
                    t.names()[0]
                ));
            }
        }
        if self.dropout > 0.0 && targets.iter().any(|t| t.is_parameter()) {
            return bad(format!(
                "LoRA dropout ({}) on the router and experts is not supported: PEFT's \
                 adapters on parameters have none; use dropout 0 or leave out router, \
                 experts.gate_up and experts.down",
                self.dropout
            ));
        }
        Ok(targets.into_iter().collect())
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

/// A factor of an [`ExpertAdapter`], in PEFT's layout (its `lora_A` or
/// `lora_B` is a linear layer over the experts' stacked ranks).
#[derive(Module, Debug)]
pub struct ExpertFactor<B: Backend> {
    pub weight: Param<Tensor<B, 2>>,
}

/// The adapters of one expert weight `[experts, in, out]`: expert `e`'s
/// update is `s · (x·A_e)·B_e`, `A_e` `[in, rank]`, `B_e` `[rank, out]`.
/// PEFT keeps every expert's factors in one `lora_A` `[experts·rank, in]`
/// (row `e·rank + j` is `A_e`'s column `j`) and one `lora_B`
/// `[out, rank·experts]` (column `j·experts + e` is `B_e`'s row `j`); so
/// does this, so that files load as they are.
#[derive(Module, Debug)]
pub struct ExpertAdapter<B: Backend> {
    pub lora_a: ExpertFactor<B>,
    pub lora_b: ExpertFactor<B>,
    #[module(skip)]
    pub experts: usize,
    #[module(skip)]
    pub scale: f64,
}

impl<B: Backend> ExpertAdapter<B> {
    /// Adapters for `experts` experts from `input` to `output` features,
    /// initialized as PEFT does (`lora_A` Kaiming-uniform over its `input`
    /// fan-in, `lora_B` zeros); `path` decides the parameters' ids, as in
    /// [`LoraAdapter::new`].
    pub fn new(
        experts: usize,
        input: usize,
        output: usize,
        config: &LoraConfig,
        path: &str,
        device: &B::Device,
    ) -> Self {
        let ranks = experts * config.rank;
        let factor = |name: &str, init: Initializer, shape: [usize; 2]| ExpertFactor {
            weight: Param::initialized(
                ParamId::from(path_hash(&format!("{path}.{name}.weight"))),
                init.init_with::<B, 2, _>(shape, Some(input), None, device)
                    .val()
                    .cast(config.dtype)
                    .detach()
                    .require_grad(),
            ),
        };
        // PEFT's `nn.Linear` default: bound `1/√fan_in`.
        let kaiming = Initializer::KaimingUniform {
            gain: 1.0 / 3f64.sqrt(),
            fan_out_only: false,
        };
        Self {
            lora_a: factor("lora_a", kaiming, [ranks, input]),
            lora_b: factor("lora_b", Initializer::Zeros, [output, ranks]),
            experts,
            scale: config.scale(),
        }
    }

    /// Every expert's `A_e` `[experts, in, rank]` and `B_e`
    /// `[experts, rank, out]`.
    pub fn factors(&self) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let e = self.experts;
        let [ranks, input] = self.lora_a.weight.dims();
        let [output, _] = self.lora_b.weight.dims();
        let a = self.lora_a.weight.val().reshape([e, ranks / e, input]);
        let b = self.lora_b.weight.val().reshape([output, ranks / e, e]);
        (a.swap_dims(1, 2), b.permute([2, 1, 0]))
    }

    /// `s · A_e · B_e` `[experts, in, out]`: what merging adds to the
    /// expert weight.
    pub fn delta_weight(&self) -> Tensor<B, 3> {
        let (a, b) = self.factors();
        a.matmul(b).mul_scalar(self.scale)
    }

    /// The update `s · (x_e·A_e)·B_e` of each expert's rows, in `x`'s
    /// dtype (the adapters are cast to it, as for [`LoraAdapter`]).
    ///
    /// # Shapes
    ///
    /// - `x`: `[experts, rows, in]`
    /// - output: `[experts, rows, out]`
    pub fn update(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let (a, b) = self.factors();
        let dtype = x.dtype();
        x.matmul(a.cast(dtype))
            .matmul(b.cast(dtype))
            .mul_scalar(self.scale)
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

/// The adapters of a layer's dense MLP (`mlp.{gate,up,down}_proj`) or of
/// its mixture of experts (`mlp.router`, `mlp.experts`).
#[derive(Module, Debug)]
pub struct MlpAdapters<B: Backend> {
    pub gate_proj: Option<LoraAdapter<B>>,
    pub up_proj: Option<LoraAdapter<B>>,
    pub down_proj: Option<LoraAdapter<B>>,
    pub router: Option<LoraAdapter<B>>,
    pub experts: ExpertAdapters<B>,
}

/// The adapters of a layer's expert weights (`mlp.experts.gate_up_proj`,
/// `mlp.experts.down_proj`).
#[derive(Module, Debug)]
pub struct ExpertAdapters<B: Backend> {
    pub gate_up_proj: Option<ExpertAdapter<B>>,
    pub down_proj: Option<ExpertAdapter<B>>,
}

/// A layer's adapters, named as the layer names what they adapt.
#[derive(Module, Debug)]
pub struct LayerAdapters<B: Backend> {
    pub self_attn: AttentionAdapters<B>,
    pub mlp: MlpAdapters<B>,
}

/// Where PEFT puts a target's adapter in a layer: the target's own module
/// path, but for the experts' weights, whose wrappers PEFT nests in the
/// order HF declares the weights: with both adapted, `gate_up_proj`'s is
/// the inner one (`mlp.experts.base_layer`), `down_proj`'s the outer
/// (`mlp.experts`).
fn peft_module(target: LoraTarget, targets: &[LoraTarget]) -> &'static str {
    match target {
        LoraTarget::ExpertsGateUp if targets.contains(&LoraTarget::ExpertsDown) => {
            "mlp.experts.base_layer"
        }
        LoraTarget::ExpertsGateUp | LoraTarget::ExpertsDown => "mlp.experts",
        other => other.module_path(),
    }
}

/// The adapter tensors of `targets`, each as its path in the module tree
/// and its PEFT name, for layer `layer` (`${1}` in the regexes): a path
/// `model.layers.N.lora.<module>.lora_a.weight` is named
/// `base_model.model.model.layers.N.<PEFT module>.lora_A.weight`.
fn adapter_names<'a>(
    targets: &'a [LoraTarget],
    layer: &'a str,
) -> impl Iterator<Item = (String, String)> + 'a {
    targets.iter().flat_map(move |&t| {
        let (ours, peft) = (t.module_path(), peft_module(t, targets));
        [("a", "A"), ("b", "B")].map(|(factor, peft_factor)| {
            (
                format!("model.layers.{layer}.lora.{ours}.lora_{factor}.weight"),
                format!("base_model.model.model.layers.{layer}.{peft}.lora_{peft_factor}.weight"),
            )
        })
    })
}

/// `adapter_names` as anchored regexes and their replacements, from each
/// side's names to the other's (`to_peft` picks the direction).
fn key_remapping(targets: &[LoraTarget], to_peft: bool) -> Vec<(String, String)> {
    let pattern = |name: &str| format!("^{}$", name.replace('.', r"\.").replace("(N)", r"(\d+)"));
    adapter_names(targets, "(N)")
        .map(|(ours, peft)| {
            let (from, to) = if to_peft { (ours, peft) } else { (peft, ours) };
            (pattern(&from), to.replace("(N)", "${1}"))
        })
        .collect()
}
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
    #[serde(default)]
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
        let names = |parameters: bool| {
            config
                .targets
                .iter()
                .filter(|t| t.is_parameter() == parameters)
                .map(|t| t.hf_name())
                .collect::<Vec<_>>()
        };
        Self {
            peft_type: "LORA".into(),
            task_type: Some("CAUSAL_LM".into()),
            r: config.rank,
            lora_alpha: config.alpha,
            lora_dropout: config.dropout,
            use_rslora: config.rslora,
            // PEFT's way to adapt parameters only: an empty list.
            target_modules: Value::from(names(false)),
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
            target_parameters: Some(names(true))
                .filter(|names| !names.is_empty())
                .map(Value::from),
            layer_replication: None,
            trainable_token_indices: None,
            base_model_name_or_path: config.base_model.clone(),
            inference_mode: true,
        }
    }

    /// The LoRA config it describes, or an error naming what Bastile does
    /// not support.
    fn lora<'a>(&'a self, path: &Path) -> Result<LoraConfig, ModelError> {
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
            ("`layer_replication`", &self.layer_replication),
            ("`trainable_token_indices`", &self.trainable_token_indices),
        ] {
            if set(value) {
                return unsupported(name);
            }
        }
        let names = |field: &str, list: &'a Value| -> Result<Vec<&'a str>, ModelError> {
            let Value::Array(names) = list else {
                return Ok(vec![]);
            };
            names
                .iter()
                .map(|n| {
                    n.as_str().ok_or_else(|| {
                        ModelError::Config(format!(
                            "{}: `{field}` holds {n}, not a name",
                            path.display()
                        ))
                    })
                })
                .collect()
        };
        let mut targets = match &self.target_modules {
            Value::String(s) if s == "all-linear" => LoraTarget::LINEAR.to_vec(),
            list @ (Value::Array(_) | Value::Null) => {
                targets_named(names("target_modules", list)?, LoraTarget::parse_linear)?
            }
            other => {
                return unsupported(&format!(
                    "`target_modules` {other} (a list of names or \"all-linear\")"
                ));
            }
        };
        if let Some(list) = &self.target_parameters {
            let parameters = names("target_parameters", list)?;
            targets.extend(targets_named(parameters, LoraTarget::parse_parameter)?);
        }
        if targets.is_empty() {
            return unsupported("an adapter without `target_modules` or `target_parameters`");
        }
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
    /// to each layer (see the [module](self) docs); the model's
    /// [`CausalLm::lora_config`] then lists the targets it has. Errors on
    /// a rank of 0, an alpha that is not positive, a dropout outside
    /// `[0, 1)` (or any on the router and experts), no targets, a target
    /// the architecture does not have, or a model that already has
    /// adapters.
    pub fn with_lora(self, config: LoraConfig, device: &B::Device) -> Result<Self, ModelError> {
        let experts = self.config.moe.map(|m| m.experts);
        let config = LoraConfig {
            targets: config.model_targets(self.config.architecture, experts.is_some())?,
            ..config
        };
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
        let experts = experts.unwrap_or(0);
        for (n, layer) in model.model.layers.iter_mut().enumerate() {
            let path = |t: LoraTarget| format!("model.layers.{n}.lora.{}", t.module_path());
            let adapter = |t: LoraTarget, i, o| {
                config
                    .has(t)
                    .then(|| LoraAdapter::new(i, o, &config, &path(t), device))
            };
            let expert_adapter = |t: LoraTarget, i, o| {
                config
                    .has(t)
                    .then(|| ExpertAdapter::new(experts, i, o, &config, &path(t), device))
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
                    router: adapter(LoraTarget::Router, h, experts),
                    experts: ExpertAdapters {
                        gate_up_proj: expert_adapter(LoraTarget::ExpertsGateUp, h, 2 * inter),
                        down_proj: expert_adapter(LoraTarget::ExpertsDown, inter, h),
                    },
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
            let a = adapters.mlp;
            match &mut layer.mlp {
                crate::mlp::Mlp::Dense(mlp) => {
                    merge(&mut mlp.gate_proj, a.gate_proj);
                    merge(&mut mlp.up_proj, a.up_proj);
                    merge(&mut mlp.down_proj, a.down_proj);
                }
                crate::mlp::Mlp::Experts(moe) => {
                    merge(&mut moe.router, a.router);
                    let experts = &mut moe.experts;
                    if let Some(a) = a.experts.gate_up_proj {
                        fold(&mut experts.gate_up_proj, a.delta_weight());
                    }
                    if let Some(a) = a.experts.down_proj {
                        fold(&mut experts.down_proj, a.delta_weight());
                    }
                }
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
        for (from, to) in key_remapping(&config.targets, true) {
            store = store.with_key_remapping(&from, &to);
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
        // The targets the model has (`all-linear` on GPT-OSS: attention).
        let targets = model.lora.as_ref().map_or(vec![], |c| c.targets.clone());
        let mut store = SafetensorsStore::from_file(&file)
            .with_from_adapter(PyTorchToBurnAdapter)
            .skip_enum_variants(true)
            .allow_partial(true)
            // Shape mismatches come back in the result, to be reported
            // with PEFT's names.
            .validate(false);
        for (from, to) in key_remapping(&targets, false) {
            store = store.with_key_remapping(&from, &to);
        }
        let result = load_file_into(&mut model, &mut store, &file)?;
        // The base model's tensors are not in the file.
        let missing: Vec<String> = result
            .missing
            .into_iter()
            .map(|(path, _)| path)
            .filter(|p| is_adapter_path(p))
            .collect();
        let name = |path: &str| peft_name(&targets, path);
        report_problems(&result.errors, &missing, &result.unused, dir, &name)?;
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

/// PEFT's name of the module path of an adapter tensor of `targets`
/// (other paths as they are): `model.layers.N.lora.X.Y.lora_a.weight` →
/// `base_model.model.model.layers.N.X.Y.lora_A.weight`.
fn peft_name(targets: &[LoraTarget], path: &str) -> String {
    let layer = path
        .strip_prefix("model.layers.")
        .and_then(|rest| rest.split('.').next())
        .unwrap_or_default();
    adapter_names(targets, layer)
        .find(|(ours, _)| ours == path)
        .map_or_else(|| path.into(), |(_, peft)| peft)
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
    if let Some(adapter) = adapter {
        fold(&mut linear.weight, adapter.delta_weight());
    }
}

/// Adds `delta` to `weight` in `delta`'s dtype, keeping `weight`'s.
fn fold<B: Backend, const D: usize>(weight: &mut Param<Tensor<B, D>>, delta: Tensor<B, D>) {
    *weight = weight.clone().map(|w| {
        let dtype = w.dtype();
        (w.cast(delta.dtype()) + delta).cast(dtype).detach()
    });
}
