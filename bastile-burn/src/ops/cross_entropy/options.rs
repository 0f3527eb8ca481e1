//! The cross-entropy losses' options, and the spec they resolve to.

use crate::BastileError;

/// How per-token losses are combined.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
pub enum Reduction {
    /// The sum over counted tokens divided by their number (or by
    /// [`CrossEntropyOptions::normalizer`]).
    #[default]
    Mean,
    /// The sum over counted tokens.
    Sum,
    /// One loss per token (0 at ignored tokens).
    None,
}

/// How the fused linear cross-entropy sums the weight's gradient over
/// several chunks of tokens.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum WeightGradSum {
    /// A second pass over slices of the vocabulary takes each slice's
    /// gradient as one product over every token, rounded once: the
    /// logits of every token are computed again (four products over the
    /// logits instead of three). Its peak holds `dW` and one small slice
    /// of logits.
    Exact,
    /// Each chunk's product is added into the gradient in the weight's
    /// dtype, which rounds the running sum once per chunk (Liger-Kernel's
    /// default): three products over the logits, and the cross-entropy
    /// kernel runs once. `dW` is then held through the forward pass's
    /// chunk loop beside a chunk of logits, so the chunks are sized like
    /// the loss's input (as Liger-Kernel sizes them; at least 256 tokens,
    /// at most 256 MiB of logits) rather than as large as the budget.
    ///
    /// The default: on an H200 it trained Llama-3.2-1B at 4 × 8192 tokens
    /// 5% faster than `Exact`, with peak memory within a few MiB of it at
    /// most lengths (`benches/results/loss-chunks-default-h200/`).
    #[default]
    Chunks,
}

/// Options of the cross-entropy losses.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CrossEntropyOptions {
    /// Tokens with this label count for nothing (PyTorch's default, -100).
    pub ignore_index: i64,
    pub reduction: Reduction,
    /// With [`Reduction::Mean`], divide by this instead of the number of
    /// counted tokens: the token count of all micro-batches of a
    /// gradient-accumulation step, so their gradients add up to the mean.
    pub normalizer: Option<f64>,
    /// ε in `[0, 1]`: the target is `(1−ε)·onehot + ε/V`.
    pub label_smoothing: f64,
    /// λ ≥ 0 of the `λ·lse²` z-loss term.
    pub z_loss: f64,
    /// Soft cap `c > 0` of the logits (`c · tanh(x / c)`).
    pub softcap: Option<f64>,
    /// Tokens per chunk of the fused linear cross-entropy; chosen from the
    /// token count, vocabulary and device memory when `None`.
    pub chunk_size: Option<usize>,
    /// How the fused linear cross-entropy sums the weight's gradient when
    /// its tokens take several chunks.
    pub weight_grad_sum: WeightGradSum,
    /// Check the labels on the device and hand the result back as
    /// [`CrossEntropyOutput::label_check`](super::CrossEntropyOutput::label_check)
    /// instead of waiting for it: the loss is queued without reading
    /// anything back, and the caller reads the check when it reads the loss
    /// (a training step does so once, at its end). Until then an
    /// out-of-range label counts for nothing.
    pub defer_label_check: bool,
}

impl Default for CrossEntropyOptions {
    fn default() -> Self {
        Self {
            ignore_index: -100,
            reduction: Reduction::Mean,
            normalizer: None,
            label_smoothing: 0.0,
            z_loss: 0.0,
            softcap: None,
            chunk_size: None,
            weight_grad_sum: WeightGradSum::default(),
            defer_label_check: false,
        }
    }
}

impl CrossEntropyOptions {
    pub fn with_ignore_index(self, ignore_index: i64) -> Self {
        Self {
            ignore_index,
            ..self
        }
    }

    pub fn with_reduction(self, reduction: Reduction) -> Self {
        Self { reduction, ..self }
    }

    pub fn with_normalizer(self, normalizer: f64) -> Self {
        Self {
            normalizer: Some(normalizer),
            ..self
        }
    }

    pub fn with_label_smoothing(self, label_smoothing: f64) -> Self {
        Self {
            label_smoothing,
            ..self
        }
    }

    pub fn with_z_loss(self, z_loss: f64) -> Self {
        Self { z_loss, ..self }
    }

    pub fn with_softcap(self, softcap: f64) -> Self {
        Self {
            softcap: Some(softcap),
            ..self
        }
    }

    pub fn with_chunk_size(self, chunk_size: usize) -> Self {
        Self {
            chunk_size: Some(chunk_size),
            ..self
        }
    }

    /// See [`CrossEntropyOptions::weight_grad_sum`].
    pub fn with_weight_grad_sum(self, weight_grad_sum: WeightGradSum) -> Self {
        Self {
            weight_grad_sum,
            ..self
        }
    }

    /// See [`CrossEntropyOptions::defer_label_check`].
    pub fn with_deferred_label_check(self) -> Self {
        Self {
            defer_label_check: true,
            ..self
        }
    }

    fn validate(&self) -> Result<(), BastileError> {
        let bad = |why: String| Err(BastileError::Config(why));
        if !(0.0..=1.0).contains(&self.label_smoothing) {
            return bad(format!(
                "label_smoothing must lie in [0, 1], got {}",
                self.label_smoothing
            ));
        }
        if !(self.z_loss.is_finite() && self.z_loss >= 0.0) {
            return bad(format!(
                "z_loss must be finite and non-negative, got {}",
                self.z_loss
            ));
        }
        if let Some(c) = self.softcap
            && !(c.is_finite() && c > 0.0)
        {
            return bad(format!("softcap must be finite and positive, got {c}"));
        }
        if let Some(n) = self.normalizer
            && !(n.is_finite() && n > 0.0)
        {
            return bad(format!("normalizer must be finite and positive, got {n}"));
        }
        if self.chunk_size == Some(0) {
            return bad("chunk_size must be at least 1".into());
        }
        Ok(())
    }
}

/// What the backend methods take: the validated options, with the factor
/// the summed loss is multiplied by (`1/normalizer` for a mean) resolved.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossSpec {
    pub ignore_index: i64,
    pub reduction: Reduction,
    pub label_smoothing: f64,
    pub z_loss: f64,
    pub softcap: Option<f64>,
    /// Multiplies the summed loss (`Mean`, `Sum`) and every gradient.
    pub scale: f64,
    pub chunk_size: Option<usize>,
    pub weight_grad_sum: WeightGradSum,
}

impl LossSpec {
    /// A plain spec (mean over every token, no smoothing, z-loss or cap),
    /// for support checks.
    pub fn probe() -> Self {
        Self {
            ignore_index: -100,
            reduction: Reduction::Mean,
            label_smoothing: 0.0,
            z_loss: 0.0,
            softcap: None,
            scale: 1.0,
            chunk_size: None,
            weight_grad_sum: WeightGradSum::default(),
        }
    }
}

/// `(loss, lse)` as the backend methods return them.
pub type LossPair<T> = (T, T);

/// What a mean divides the summed loss by on the host: the normalizer, else
/// the token count when it was read back. `None` leaves a mean's count on
/// the device: [`spec`] then sums and [`output`] divides by the count.
pub(super) fn host_divisor(options: &CrossEntropyOptions, counted: Option<usize>) -> Option<f64> {
    options.normalizer.or(counted.map(|c| c.max(1) as f64))
}

/// Validates the options and resolves the loss scale.
pub(crate) fn spec(
    options: &CrossEntropyOptions,
    counted: Option<usize>,
) -> Result<LossSpec, BastileError> {
    options.validate()?;
    let scale = match (options.reduction, host_divisor(options, counted)) {
        (Reduction::Mean, Some(divisor)) => 1.0 / divisor,
        _ => 1.0,
    };
    Ok(LossSpec {
        ignore_index: options.ignore_index,
        reduction: options.reduction,
        label_smoothing: options.label_smoothing,
        z_loss: options.z_loss,
        softcap: options.softcap,
        scale,
        chunk_size: options.chunk_size,
        weight_grad_sum: options.weight_grad_sum,
    })
}
