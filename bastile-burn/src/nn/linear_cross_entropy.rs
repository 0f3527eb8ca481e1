//! `LinearCrossEntropyLoss`: the language-model head and its loss in one
//! call, without the `[tokens, vocab]` logits.

use burn::config::Config;
use burn::tensor::{Int, Tensor};

use crate::ops::cross_entropy::{
    CrossEntropyOptions, CrossEntropyOutput, Reduction, WeightGradSum,
};
use crate::ops::linear_cross_entropy::linear_cross_entropy;
use crate::{BastileBackend, BastileError};

/// Configuration of [`LinearCrossEntropyLoss`].
#[derive(Config, Debug)]
pub struct LinearCrossEntropyLossConfig {
    /// Labels that count for nothing (PyTorch's -100 by default).
    #[config(default = -100)]
    pub ignore_index: i64,
    /// How per-token losses combine.
    #[config(default = "Reduction::Mean")]
    pub reduction: Reduction,
    /// Label smoothing ε in `[0, 1]`.
    #[config(default = 0.0)]
    pub label_smoothing: f64,
    /// Coefficient of the `lse²` z-loss.
    #[config(default = 0.0)]
    pub z_loss: f64,
    /// Soft cap of the logits.
    pub softcap: Option<f64>,
    /// Tokens per chunk (chosen automatically when unset).
    pub chunk_size: Option<usize>,
    /// How the weight's gradient sums over several chunks.
    #[config(default = "WeightGradSum::Chunks")]
    pub weight_grad_sum: WeightGradSum,
}

impl LinearCrossEntropyLossConfig {
    /// The loss.
    pub fn init(&self) -> LinearCrossEntropyLoss {
        LinearCrossEntropyLoss {
            options: CrossEntropyOptions {
                ignore_index: self.ignore_index,
                reduction: self.reduction,
                normalizer: None,
                label_smoothing: self.label_smoothing,
                z_loss: self.z_loss,
                softcap: self.softcap,
                chunk_size: self.chunk_size,
                weight_grad_sum: self.weight_grad_sum,
                defer_label_check: false,
            },
        }
    }
}

/// Cross-entropy of `hidden · weightᵀ (+ bias)` against labels: a causal
/// LM's `lm_head` and loss, fused under `Bastile<B>` (chunked, the logits
/// never materialized) and the plain composite elsewhere.
#[derive(Clone, Debug)]
pub struct LinearCrossEntropyLoss {
    pub options: CrossEntropyOptions,
}

impl LinearCrossEntropyLoss {
    /// The loss of `hidden` `[batch, seq, H]` against `labels`
    /// `[batch, seq]` (already shifted), with the head's `weight` `[V, H]`.
    ///
    /// # Shapes
    ///
    /// - `hidden`: `[batch, seq, H]`
    /// - `weight`: `[V, H]`; `labels`: `[batch, seq]`
    /// - output: [`CrossEntropyOutput`](crate::CrossEntropyOutput), its `loss` `[1]` (`Mean`, `Sum`) or `[batch · seq]` (`None`)
    pub fn forward<B: BastileBackend>(
        &self,
        hidden: Tensor<B, 3>,
        weight: Tensor<B, 2>,
        bias: Option<Tensor<B, 1>>,
        labels: Tensor<B, 2, Int>,
    ) -> Result<CrossEntropyOutput<B>, BastileError> {
        let [b, s, h] = hidden.dims();
        let [lb, ls] = labels.dims();
        if (lb, ls) != (b, s) {
            return Err(BastileError::Shape(format!(
                "hidden is [{b}, {s}, {h}] but labels are [{lb}, {ls}]"
            )));
        }
        self.forward_flat(
            hidden.reshape([b * s, h]),
            weight,
            bias,
            labels.reshape([b * s]),
        )
    }

    /// [`LinearCrossEntropyLoss::forward`] on flattened tokens: `hidden`
    /// `[N, H]`, `labels` `[N]`.
    ///
    /// # Shapes
    ///
    /// - `hidden`: `[N, H]`
    /// - `weight`: `[V, H]`; `labels`: `[N]`
    /// - output: as [`LinearCrossEntropyLoss::forward`]'s
    pub fn forward_flat<B: BastileBackend>(
        &self,
        hidden: Tensor<B, 2>,
        weight: Tensor<B, 2>,
        bias: Option<Tensor<B, 1>>,
        labels: Tensor<B, 1, Int>,
    ) -> Result<CrossEntropyOutput<B>, BastileError> {
        linear_cross_entropy(hidden, weight, bias, labels, self.options)
    }

    /// The loss through a `burn::nn::Linear` head (whose weight is stored
    /// `[H, V]`).
    pub fn forward_linear<B: BastileBackend>(
        &self,
        hidden: Tensor<B, 3>,
        head: &burn::nn::Linear<B>,
        labels: Tensor<B, 2, Int>,
    ) -> Result<CrossEntropyOutput<B>, BastileError> {
        let weight = head.weight.val().transpose();
        let bias = head.bias.as_ref().map(|b| b.val());
        self.forward(hidden, weight, bias, labels)
    }
}
