//! GPT-OSS mixture of experts: a router (linear with bias, top-k of the
//! logits, softmax over the k), experts with interleaved `gate_up` columns
//! and biases, the clamped GEGLU (Bastile's fused op) and a down projection
//! with bias, combined with the routing weights.
//!
//! Two ways to run the experts ([`ExpertRouting`]), the same function:
//! every expert on every token with weight 0 where it was not chosen
//! (batched matmuls at `experts / top_k` times the expert flops), or each
//! expert on the tokens routed to it.
//!
//! LoRA adapters ([`MlpAdapters`]) add their updates to the router's
//! logits and to each expert's products.

use bastile::{
    BastileBackend, batched_linear, combine_rows, gather_rows, geglu_oss, group_by_expert,
    router_top_k,
};
use burn::module::{Module, Param};
use burn::nn::{Initializer, Linear, LinearConfig};
use burn::tensor::activation::softmax;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, IndexingUpdateOp, Int, Tensor};

use crate::ModelError;
use crate::config::{MoeConfig, check_router_aux_loss};
use crate::lora::{ExpertAdapter, ExpertAdapters, MlpAdapters, project};

/// GPT-OSS's GEGLU slope.
const ALPHA: f64 = 1.702;

/// Rows the routed path's group capacity is a multiple of (unless every
/// token fits in fewer): up to this many padding rows per expert, for few
/// distinct product shapes.
pub const CAPACITY_STEP: usize = 64;

/// HF's `experts`: `gate_up_proj` `[E, H, 2I]`, `down_proj` `[E, I, H]`.
#[derive(Module, Debug)]
pub struct Experts<B: Backend> {
    pub gate_up_proj: Param<Tensor<B, 3>>,
    pub gate_up_proj_bias: Param<Tensor<B, 2>>,
    pub down_proj: Param<Tensor<B, 3>>,
    pub down_proj_bias: Param<Tensor<B, 2>>,
}

/// How [`Moe`] runs its experts; both give the same outputs and gradients
/// up to the order of floating-point sums. Routed by default; the dense
/// path is the composite reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExpertRouting {
    /// Every expert on every token, its output weighted 0 where the router
    /// did not choose it: batched matmuls over all experts, no host reads,
    /// `experts / top_k` times the routed path's expert flops.
    Dense,
    /// Each expert on the tokens routed to it: the token-expert assignments
    /// grouped by expert on the device (their counts read back to the host
    /// once per layer), the groups padded to the largest one (in steps of
    /// 64 rows), one batched `gate_up` and one `down` product over them,
    /// each token's rows weighted and summed. About `top_k / experts` of
    /// the dense path's expert flops and activations when the experts'
    /// loads are even, never more than the dense path's (one expert taking
    /// every token).
    #[default]
    Routed,
}

/// HF's `mlp` of a GPT-OSS layer: `router` and `experts`.
#[derive(Module, Debug)]
pub struct Moe<B: Backend> {
    pub router: Linear<B>,
    pub experts: Experts<B>,
    #[module(skip)]
    pub top_k: usize,
    #[module(skip)]
    pub limit: f64,
    #[module(skip)]
    pub routing: ExpertRouting,
}

impl<B: Backend> Moe<B> {
    pub fn new(hidden: usize, inter: usize, config: MoeConfig, device: &B::Device) -> Self {
        let e = config.experts;
        let init = Initializer::Normal {
            mean: 0.0,
            std: 0.02,
        };
        Moe {
            router: LinearConfig::new(hidden, e).with_bias(true).init(device),
            experts: Experts {
                gate_up_proj: init.init([e, hidden, 2 * inter], device),
                gate_up_proj_bias: Initializer::Zeros.init([e, 2 * inter], device),
                down_proj: init.init([e, inter, hidden], device),
                down_proj_bias: Initializer::Zeros.init([e, hidden], device),
            },
            top_k: config.top_k,
            limit: config.limit,
            routing: ExpertRouting::default(),
        }
    }
}

impl<B: BastileBackend> Moe<B> {
    /// `x` `[batch, seq, hidden]` → `[batch, seq, hidden]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Result<Tensor<B, 3>, ModelError> {
        Ok(self.forward_with_load(x, None, false)?.0)
    }

    /// [`Moe::forward`] with `adapters`' updates on the router and the
    /// experts (their dense-MLP adapters unused), and the layer's
    /// [`RouterLoad`] when `router_load` (for the load-balancing loss).
    pub fn forward_with_load(
        &self,
        x: Tensor<B, 3>,
        adapters: Option<&MlpAdapters<B>>,
        router_load: bool,
    ) -> Result<(Tensor<B, 3>, Option<RouterLoad<B>>), ModelError> {
        let [b, s, h] = x.dims();
        let x = x.reshape([b * s, h]);
        let router = adapters.and_then(|a| a.router.as_ref());
        let experts = adapters.map(|a| &a.experts);
        let logits = project(&self.router, router, x.clone())?;
        // The k largest logits' experts and the softmax over those k, chosen
        // on the device.
        let (weights, chosen) = router_top_k(logits.clone(), self.top_k)?;
        let load = router_load.then(|| RouterLoad::new(logits.clone(), chosen.clone()));
        let out = match self.routing {
            ExpertRouting::Dense => self.dense(x, logits, weights, chosen, experts)?,
            ExpertRouting::Routed => self.routed(x, weights, chosen, experts)?,
        };
        Ok((out.reshape([b, s, h]), load))
    }

    /// Every expert on every token; the routing weights are spread over
    /// `[tokens, experts]` (the router logits' shape), 0 where not chosen.
    fn dense(
        &self,
        x: Tensor<B, 2>,
        logits: Tensor<B, 2>,
        weights: Tensor<B, 2>,
        chosen: Tensor<B, 2, Int>,
        adapters: Option<&ExpertAdapters<B>>,
    ) -> Result<Tensor<B, 2>, ModelError> {
        let [t, h] = x.dims();
        let [_, e] = logits.dims();
        let weights = logits
            .zeros_like()
            .scatter(1, chosen, weights, IndexingUpdateOp::Add);
        let out = self.expert_outputs(x.unsqueeze::<3>().expand([e, t, h]), adapters)?;
        let weighted = out * weights.transpose().unsqueeze_dim::<3>(2);
        Ok(weighted.sum_dim(0).reshape([t, h]))
    }

    /// Each expert on its rows: `gate_up` with its bias, the clamped
    /// GEGLU, `down` with its bias, each product with its adapter's update.
    ///
    /// # Shapes
    ///
    /// - `x`: `[experts, rows, hidden]`
    /// - output: `[experts, rows, hidden]`
    fn expert_outputs(
        &self,
        x: Tensor<B, 3>,
        adapters: Option<&ExpertAdapters<B>>,
    ) -> Result<Tensor<B, 3>, ModelError> {
        let ex = &self.experts;
        let adapter = |pick: fn(&ExpertAdapters<B>) -> &Option<ExpertAdapter<B>>| {
            adapters.and_then(|a| pick(a).as_ref())
        };
        let gate_up = expert_product(
            x,
            &ex.gate_up_proj,
            &ex.gate_up_proj_bias,
            adapter(|a| &a.gate_up_proj),
        )?;
        let act = geglu_oss(gate_up, ALPHA, self.limit)?;
        expert_product(
            act,
            &ex.down_proj,
            &ex.down_proj_bias,
            adapter(|a| &a.down_proj),
        )
    }

    /// Each expert on its own tokens: the token-expert assignments grouped
    /// by expert on the device (only the group sizes read back, once per
    /// layer), every group padded to `capacity` rows (the largest group's,
    /// rounded up to [`CAPACITY_STEP`] rows), one batched product per
    /// projection over `[experts, capacity, ·]` ([`batched_linear`], each
    /// expert's bias in the product's epilogue), and each token's `top_k`
    /// rows weighted and summed where they are ([`combine_rows`]). The
    /// gather and the combination know their inverses: their gradients are
    /// gathered too.
    fn routed(
        &self,
        x: Tensor<B, 2>,
        weights: Tensor<B, 2>,
        chosen: Tensor<B, 2, Int>,
        adapters: Option<&ExpertAdapters<B>>,
    ) -> Result<Tensor<B, 2>, ModelError> {
        let [t, h] = x.dims();
        let k = self.top_k;
        let experts = self.experts.gate_up_proj.dims()[0];
        // Row `e * capacity + i` of the groups holds expert `e`'s `i`-th
        // assignment in token order; rows past an expert's count repeat
        // token 0 and no choice combines them, so they add nothing to any
        // gradient. Each pass's inverse takes its gradient back: token
        // `t`'s rows are `row_of_slot[t]`, row `r`'s assignment is
        // `slot_of_row[r]` (`t * k`, none, for the padding).
        let groups = group_by_expert(chosen, experts, CAPACITY_STEP)?;
        let (capacity, rows) = (groups.capacity, experts * groups.capacity);
        let row_of_slot = groups.row_of_slot.reshape([t, k]);
        let grouped = gather_rows(x, groups.token_of_row, row_of_slot.clone())?
            .reshape([experts, capacity, h]);
        let out = self.expert_outputs(grouped, adapters)?;
        Ok(combine_rows(
            out.reshape([rows, h]),
            weights,
            row_of_slot,
            groups.slot_of_row,
        )?)
    }
}

/// Each expert's rows times its weight, plus its bias and its adapter's
/// update.
///
/// # Shapes
///
/// - `x`: `[experts, rows, in]`
/// - `weight`: `[experts, in, out]`, `bias`: `[experts, out]`
/// - output: `[experts, rows, out]`
fn expert_product<B: BastileBackend>(
    x: Tensor<B, 3>,
    weight: &Param<Tensor<B, 3>>,
    bias: &Param<Tensor<B, 2>>,
    adapter: Option<&ExpertAdapter<B>>,
) -> Result<Tensor<B, 3>, ModelError> {
    let y = batched_linear(x.clone(), weight.val(), Some(bias.val()))?;
    Ok(match adapter {
        Some(adapter) => y + adapter.update(x),
        None => y,
    })
}

/// One layer's part of HF's load-balancing loss (`load_balancing_loss_func`,
/// Switch Transformer's `experts · Σ_e f_e · P_e`, where `f_e` is the share
/// of token-expert assignments expert `e` received and `P_e` the router's
/// mean softmax probability for it, over every layer's tokens).
#[derive(Debug, Clone)]
pub struct RouterLoad<B: Backend> {
    /// `[experts]`, f32: the token-expert assignments each expert received
    /// (constants: the top-k choice has no gradient).
    pub assigned: Tensor<B, 1>,
    /// `[experts]`, f32: the router's softmax over all experts, summed over
    /// the tokens.
    pub probability: Tensor<B, 1>,
    /// The tokens the router saw.
    pub tokens: usize,
}

impl<B: Backend> RouterLoad<B> {
    /// The load of router `logits` `[tokens, experts]` that chose `chosen`
    /// `[tokens, top_k]`.
    fn new(logits: Tensor<B, 2>, chosen: Tensor<B, 2, Int>) -> Self {
        let [tokens, experts] = logits.dims();
        let assignments = tokens * chosen.dims()[1];
        let device = logits.device();
        // One row per assignment, true in its expert's column: summed in
        // parallel (a scatter into `[experts]` walks the assignments one
        // after another).
        let expert_ids = Tensor::<B, 1, Int>::arange(0..experts as i64, &device)
            .reshape([1, experts])
            .expand([assignments, experts]);
        let assigned = chosen
            .reshape([assignments, 1])
            .expand([assignments, experts])
            .equal(expert_ids)
            .float()
            .cast(DType::F32)
            .sum_dim(0)
            .reshape([experts])
            .detach();
        let probability = softmax(logits.cast(DType::F32), 1)
            .sum_dim(0)
            .reshape([experts]);
        RouterLoad {
            assigned,
            probability,
            tokens,
        }
    }

    /// The load-balancing loss of the layers' `loads` is
    /// `Σ_l probability_l · weights`: these weights (`[experts]`, constants).
    pub fn loss_weights(loads: &[RouterLoad<B>]) -> Option<Tensor<B, 1>> {
        let rows: usize = loads.iter().map(|l| l.tokens).sum();
        let assigned = loads
            .iter()
            .map(|l| l.assigned.clone())
            .reduce(|a, b| a + b)?;
        let [experts] = assigned.dims();
        Some(assigned * (experts as f64 / (rows as f64 * rows as f64)))
    }

    /// This layer's part of the loss, `[1]`, with `weights` from
    /// [`RouterLoad::loss_weights`] (scaled as the loss is).
    pub fn loss_term(&self, weights: Tensor<B, 1>) -> Tensor<B, 1> {
        (self.probability.clone() * weights).sum()
    }

    /// The loss of every layer's `loads`, `[1]`: the sum of their
    /// [`RouterLoad::loss_term`]s with `weights`.
    pub fn loss(loads: &[RouterLoad<B>], weights: Tensor<B, 1>) -> Option<Tensor<B, 1>> {
        loads
            .iter()
            .map(|load| load.loss_term(weights.clone()))
            .reduce(|a, b| a + b)
    }
}

impl<B: AutodiffBackend> RouterLoad<B> {
    /// The load without its graph.
    pub fn inner(self) -> RouterLoad<B::InnerBackend> {
        RouterLoad {
            assigned: self.assigned.inner(),
            probability: self.probability.inner(),
            tokens: self.tokens,
        }
    }
}

impl<B: Backend> crate::CausalLm<B> {
    /// The model with its mixture-of-experts layers running their experts
    /// as `routing` says; an error for a model without experts.
    pub fn with_expert_routing(mut self, routing: ExpertRouting) -> Result<Self, ModelError> {
        self.moe_config(&format!("expert routing ({routing:?})"))?;
        for layer in &mut self.model.layers {
            if let crate::mlp::Mlp::Experts(moe) = &mut layer.mlp {
                moe.routing = routing;
            }
        }
        Ok(self)
    }

    /// How the model's mixture-of-experts layers run their experts; `None`
    /// for a model without experts.
    pub fn expert_routing(&self) -> Option<ExpertRouting> {
        self.model.layers.iter().find_map(|layer| match &layer.mlp {
            crate::mlp::Mlp::Experts(moe) => Some(moe.routing),
            crate::mlp::Mlp::Dense(_) => None,
        })
    }

    /// The model with the router's load-balancing loss added to its loss
    /// with weight `coef` (HF's `output_router_logits` with
    /// `router_aux_loss_coef`), or without it (`None`). The loss counts
    /// every position of the batch, as HF's does without an attention mask;
    /// a micro-batch's part is weighted by its counted tokens, as its
    /// cross-entropy is. An error for a model without experts or a
    /// coefficient that is negative or not finite.
    pub fn with_router_aux_loss(mut self, coef: Option<f64>) -> Result<Self, ModelError> {
        let coef = coef.map(check_router_aux_loss).transpose()?;
        let what = match coef {
            Some(c) => format!("a router load-balancing loss (coefficient {c})"),
            None => "a router load-balancing loss setting".into(),
        };
        let moe = self.moe_config(&what)?;
        self.config.moe = Some(MoeConfig {
            router_aux_loss: coef,
            ..moe
        });
        Ok(self)
    }

    /// The weight of the router's load-balancing loss in the training
    /// loss, when the model adds one ([`CausalLm::with_router_aux_loss`]).
    ///
    /// [`CausalLm::with_router_aux_loss`]: crate::CausalLm::with_router_aux_loss
    pub fn router_aux_loss(&self) -> Option<f64> {
        self.config.moe.and_then(|m| m.router_aux_loss)
    }

    /// The mixture-of-experts settings, or an error naming `what` needs them.
    fn moe_config(&self, what: &str) -> Result<MoeConfig, ModelError> {
        self.config.moe.ok_or_else(|| {
            ModelError::Config(format!(
                "{what} needs a mixture-of-experts model; {:?} has none",
                self.config.architecture
            ))
        })
    }
}
