//! GPT-OSS mixture of experts: a router (linear with bias, top-k of the
//! logits, softmax over the k), experts with interleaved `gate_up` columns
//! and biases, the clamped GEGLU (Bastile's fused op) and a down projection
//! with bias, combined with the routing weights.
//!
//! Every expert runs on every token with weight 0 where it was not chosen
//! (HF's training formulation): exact, and simple batched matmuls, at
//! `experts / top_k` times the expert flops of a gathered implementation.

use bastile::{BastileBackend, geglu_oss};
use burn::module::{Module, Param};
use burn::nn::{Initializer, Linear, LinearConfig};
use burn::tensor::activation::softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{IndexingUpdateOp, Tensor};

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

/// HF's `mlp` of a GPT-OSS layer: `router` and `experts`.
#[derive(Module, Debug)]
pub struct Moe<B: Backend> {
    pub router: Linear<B>,
    pub experts: Experts<B>,
    #[module(skip)]
    pub top_k: usize,
    #[module(skip)]
    pub limit: f64,
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
        }
    }
}

impl<B: BastileBackend> Moe<B> {
    /// `x` `[batch, seq, hidden]` → `[batch, seq, hidden]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Result<Tensor<B, 3>, ModelError> {
        let [b, s, h] = x.dims();
        let t = b * s;
        let x = x.reshape([t, h]);
        let logits = self.router.forward(x.clone());
        let [_, e] = logits.dims();
        let (top, index) = logits.clone().topk_with_indices(self.top_k, 1);
        let weights = logits
            .zeros_like()
            .scatter(1, index, softmax(top, 1), IndexingUpdateOp::Add);
        let ex = &self.experts;
        let gate_up = x
            .unsqueeze::<3>()
            .expand([e, t, h])
            .matmul(ex.gate_up_proj.val())
            + ex.gate_up_proj_bias.val().unsqueeze_dim(1);
        let act = geglu_oss(gate_up, ALPHA, self.limit)?;
        let out = act.matmul(ex.down_proj.val()) + ex.down_proj_bias.val().unsqueeze_dim(1);
        let weighted = out * weights.transpose().unsqueeze_dim::<3>(2);
        Ok(weighted.sum_dim(0).reshape([b, s, h]))
    }
}
