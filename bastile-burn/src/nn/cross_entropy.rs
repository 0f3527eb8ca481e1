//! `CrossEntropyLoss`, a drop-in for `burn::nn::loss::CrossEntropyLoss`.

use burn::config::Config;
use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

use crate::ops::cross_entropy::{CrossEntropyOptions, Reduction, cross_entropy};
use crate::{BastileBackend, BastileError};

/// Configuration of [`CrossEntropyLoss`]: the fields of
/// `burn::nn::loss::CrossEntropyLossConfig`.
#[derive(Config, Debug)]
pub struct CrossEntropyLossConfig {
    /// Labels that count for nothing (padding).
    pub pad_tokens: Option<Vec<usize>>,
    /// Per-class weights (served by Burn's own loss, not fused).
    pub weights: Option<Vec<f32>>,
    /// Label smoothing α in `[0, 1]`.
    pub smoothing: Option<f32>,
    /// Whether the inputs are logits (`false`: probabilities, served by
    /// Burn's own loss, not fused).
    #[config(default = true)]
    pub logits: bool,
}

impl CrossEntropyLossConfig {
    /// Initializes the loss. Panics on invalid values, as Burn's does;
    /// [`CrossEntropyLossConfig::try_init`] returns the error instead.
    pub fn init<B: Backend>(&self, device: &B::Device) -> CrossEntropyLoss<B> {
        self.try_init(device).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Initializes the loss, or says why the configuration is invalid.
    pub fn try_init<B: Backend>(
        &self,
        device: &B::Device,
    ) -> Result<CrossEntropyLoss<B>, BastileError> {
        if let Some(a) = self.smoothing
            && !(0.0..=1.0).contains(&a)
        {
            return Err(BastileError::Config(format!(
                "cross-entropy smoothing must lie in [0, 1], got {a}"
            )));
        }
        if let Some(w) = &self.weights
            && w.iter().any(|w| w.is_nan() || *w <= 0.0)
        {
            return Err(BastileError::Config(
                "cross-entropy class weights must be positive".into(),
            ));
        }
        Ok(CrossEntropyLoss {
            pad_tokens: self.pad_tokens.clone(),
            weights: self
                .weights
                .as_ref()
                .map(|w| Tensor::from_floats(w.as_slice(), device)),
            smoothing: self.smoothing,
            logits: self.logits,
        })
    }
}

/// Cross-entropy of logits against class labels with Burn's semantics (the
/// mean over all rows, padding rows counting 0), computed by the fused
/// kernel under `Bastile<B>`.
#[derive(Module, Debug)]
pub struct CrossEntropyLoss<B: Backend> {
    /// Labels that count for nothing.
    pub pad_tokens: Option<Vec<usize>>,
    /// Per-class weights.
    pub weights: Option<Tensor<B, 1>>,
    /// Label smoothing factor.
    pub smoothing: Option<f32>,
    /// Whether the inputs are logits.
    pub logits: bool,
}

impl<B: BastileBackend> CrossEntropyLoss<B> {
    /// The loss of `logits` `[N, C]` against `targets` `[N]`, shape `[1]`.
    ///
    /// Panics with a descriptive message on bad shapes or labels;
    /// [`CrossEntropyLoss::try_forward`] returns the error instead.
    ///
    /// # Shapes
    ///
    /// - `logits`: `[N, C]`
    /// - `targets`: `[N]`
    /// - output: `[1]`
    pub fn forward(&self, logits: Tensor<B, 2>, targets: Tensor<B, 1, Int>) -> Tensor<B, 1> {
        self.try_forward(logits, targets)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// The loss, or why it cannot be computed.
    pub fn try_forward(
        &self,
        logits: Tensor<B, 2>,
        targets: Tensor<B, 1, Int>,
    ) -> Result<Tensor<B, 1>, BastileError> {
        if self.weights.is_some() || !self.logits {
            return Ok(self.burn_loss().forward(logits, targets));
        }
        const IGNORE: i64 = -100;
        let [n, _] = logits.dims();
        let mut labels = targets;
        for &pad in self.pad_tokens.iter().flatten() {
            let is_pad = labels.clone().equal_elem(pad as i64);
            labels = labels.mask_fill(is_pad, IGNORE);
        }
        // Burn averages over every row, padding included.
        let options = CrossEntropyOptions::default()
            .with_ignore_index(IGNORE)
            .with_reduction(Reduction::Mean)
            .with_normalizer(n.max(1) as f64)
            .with_label_smoothing(self.smoothing.unwrap_or(0.0) as f64);
        Ok(cross_entropy(logits, labels, options)?.loss)
    }

    fn burn_loss(&self) -> burn::nn::loss::CrossEntropyLoss<B> {
        burn::nn::loss::CrossEntropyLoss {
            pad_tokens: self.pad_tokens.clone(),
            weights: self.weights.clone(),
            smoothing: self.smoothing,
            logits: self.logits,
        }
    }
}
