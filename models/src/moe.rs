//! GPT-OSS mixture of experts: a router (linear with bias, top-k of the
//! logits, softmax over the k), experts with interleaved `gate_up` columns
//! and biases, the clamped GEGLU (Bastile's fused op) and a down projection
//! with bias, combined with the routing weights.
//!
//! Two ways to run the experts ([`ExpertRouting`]), the same function:
//! every expert on every token with weight 0 where it was not chosen (HF's
//! training formulation, batched matmuls at `experts / top_k` times the
//! expert flops), or each expert on the tokens routed to it.

use bastile::{BastileBackend, geglu_oss};
use burn::module::{Module, Param};
use burn::nn::{Initializer, Linear, LinearConfig};
use burn::tensor::activation::softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{IndexingUpdateOp, Int, Tensor, TensorData};

use crate::ModelError;
use crate::config::MoeConfig;

/// GPT-OSS's GEGLU slope.
const ALPHA: f64 = 1.702;

/// HF's `experts`: `gate_up_proj` `[E, H, 2I]`, `down_proj` `[E, I, H]`.
#[derive(Module, Debug)]
pub struct Experts<B: Backend> {
    pub gate_up_proj: Param<Tensor<B, 3>>,
    pub gate_up_proj_bias: Param<Tensor<B, 2>>,
    pub down_proj: Param<Tensor<B, 3>>,
    pub down_proj_bias: Param<Tensor<B, 2>>,
}

/// How [`Moe`] runs its experts; both give the same outputs and gradients
/// up to the order of floating-point sums.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExpertRouting {
    /// Every expert on every token, its output weighted 0 where the router
    /// did not choose it: batched matmuls over all experts, no host reads.
    #[default]
    Dense,
    /// Each expert on the tokens routed to it: the token-expert assignments
    /// sorted by expert (the routing is read back to the host once per
    /// layer), one `gate_up` and one `down` product per expert that received
    /// tokens, the weighted rows added back in token order. `top_k /
    /// experts` of the dense path's expert flops and activations.
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
        let [b, s, h] = x.dims();
        let x = x.reshape([b * s, h]);
        let logits = self.router.forward(x.clone());
        let (top, chosen) = logits.clone().topk_with_indices(self.top_k, 1);
        // Softmax over the k chosen logits.
        let weights = softmax(top, 1);
        let out = match self.routing {
            ExpertRouting::Dense => self.dense(x, logits, weights, chosen)?,
            ExpertRouting::Routed => self.routed(x, weights, chosen)?,
        };
        Ok(out.reshape([b, s, h]))
    }

    /// Every expert on every token; the routing weights are spread over
    /// `[tokens, experts]` (the router logits' shape), 0 where not chosen.
    fn dense(
        &self,
        x: Tensor<B, 2>,
        logits: Tensor<B, 2>,
        weights: Tensor<B, 2>,
        chosen: Tensor<B, 2, Int>,
    ) -> Result<Tensor<B, 2>, ModelError> {
        let [t, h] = x.dims();
        let [_, e] = logits.dims();
        let weights = logits
            .zeros_like()
            .scatter(1, chosen, weights, IndexingUpdateOp::Add);
        let ex = &self.experts;
        let gate_up = x
            .unsqueeze::<3>()
            .expand([e, t, h])
            .matmul(ex.gate_up_proj.val())
            + ex.gate_up_proj_bias.val().unsqueeze_dim(1);
        let act = geglu_oss(gate_up, ALPHA, self.limit)?;
        let out = act.matmul(ex.down_proj.val()) + ex.down_proj_bias.val().unsqueeze_dim(1);
        let weighted = out * weights.transpose().unsqueeze_dim::<3>(2);
        Ok(weighted.sum_dim(0).reshape([t, h]))
    }

    /// Each expert on its own tokens.
    fn routed(
        &self,
        x: Tensor<B, 2>,
        weights: Tensor<B, 2>,
        chosen: Tensor<B, 2, Int>,
    ) -> Result<Tensor<B, 2>, ModelError> {
        let [t, h] = x.dims();
        let k = self.top_k;
        let ex = &self.experts;
        let [experts, _, two_inter] = ex.gate_up_proj.dims();
        let device = x.device();
        let chosen: Vec<i64> = chosen
            .try_into_data()
            .map_err(|e| ModelError::Device(format!("reading the expert routing back: {e}")))?
            .convert::<i64>()
            .into_vec()
            .map_err(|e| ModelError::Device(format!("reading the expert routing back: {e:?}")))?;
        // Assignment `slot` is token `slot / k`'s `slot % k`-th choice; a
        // stable sort keeps each expert's tokens in token order.
        let mut slots: Vec<usize> = (0..t * k).collect();
        slots.sort_by_key(|&slot| chosen[slot]);
        let mut counts = vec![0usize; experts];
        for &expert in &chosen {
            counts[expert as usize] += 1;
        }
        let ids = |values: Vec<i64>| {
            let n = values.len();
            Tensor::<B, 1, Int>::from_data(TensorData::new(values, [n]), &device)
        };
        let tokens = ids(slots.iter().map(|&slot| (slot / k) as i64).collect());
        let sorted_slots = ids(slots.iter().map(|&slot| slot as i64).collect());
        let zeros = x.zeros_like();
        let rows = x.select(0, tokens.clone());
        let row_weights = weights.reshape([t * k]).select(0, sorted_slots);
        let mut outputs = Vec::new();
        let mut start = 0;
        for (expert, &count) in counts.iter().enumerate() {
            if count == 0 {
                continue;
            }
            let expert_rows = rows.clone().slice(start..start + count);
            start += count;
            let gate_up = expert_rows.matmul(
                ex.gate_up_proj
                    .val()
                    .slice(expert..expert + 1)
                    .reshape([h, two_inter]),
            ) + ex.gate_up_proj_bias.val().slice(expert..expert + 1);
            let act = geglu_oss(gate_up, ALPHA, self.limit)?;
            outputs.push(
                act.matmul(
                    ex.down_proj
                        .val()
                        .slice(expert..expert + 1)
                        .reshape([two_inter / 2, h]),
                ) + ex.down_proj_bias.val().slice(expert..expert + 1),
            );
        }
        let weighted = Tensor::cat(outputs, 0) * row_weights.unsqueeze_dim(1);
        Ok(zeros.select_assign(0, tokens, weighted, IndexingUpdateOp::Add))
    }
}

impl<B: Backend> crate::CausalLm<B> {
    /// The model with its mixture-of-experts layers running their experts
    /// as `routing` says; an error for a model without experts.
    pub fn with_expert_routing(mut self, routing: ExpertRouting) -> Result<Self, ModelError> {
        if self.config.moe.is_none() {
            return Err(ModelError::Config(format!(
                "expert routing ({routing:?}) needs a mixture-of-experts model; {:?} has none",
                self.config.architecture
            )));
        }
        for layer in &mut self.model.layers {
            if let crate::mlp::Mlp::Experts(moe) = &mut layer.mlp {
                moe.routing = routing;
            }
        }
        Ok(self)
    }
}
