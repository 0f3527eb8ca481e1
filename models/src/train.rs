//! A reusable training step for [`CausalLm`]: forward, the fused linear
//! cross-entropy (labels shifted, `ignore_index` for padding and prompt),
//! backward, gradient accumulation over micro-batches, gradient clipping by
//! global norm and AdamW with a warmup + cosine learning-rate schedule.
//!
//! The optimizer is Burn's AdamW after a global-norm clip, or with
//! [`OptimizerKind::Fused`] Bastile's fused AdamW
//! ([`bastile::optim::AdamW`], the clip folded in).

use bastile::optim::{AdamW as FusedAdamW, AdamWConfig as FusedAdamWConfig, MomentDtype};
use bastile::{BastileBackend, CrossEntropyOptions, Reduction};
use burn::module::AutodiffModule;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{AdamW, AdamWConfig, GradientsAccumulator, GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor};

use crate::clip::clip_grad_norm;
use crate::{CausalLm, ModelError};

/// Optimizer and schedule settings (HF `TrainingArguments` names where
/// they exist).
#[derive(Clone, Debug, PartialEq)]
pub struct TrainConfig {
    pub learning_rate: f64,
    pub warmup_steps: usize,
    /// Optimizer steps of the cosine schedule (it decays to 0 at the end).
    pub total_steps: usize,
    pub weight_decay: f32,
    pub adam_beta1: f32,
    pub adam_beta2: f32,
    pub adam_epsilon: f32,
    /// Clip the global gradient norm to this (`None`: no clipping).
    pub max_grad_norm: Option<f32>,
    pub optimizer: OptimizerKind,
    /// Fused AdamW only: f32 moments and an f32 master copy of every
    /// parameter that is not f32 (HF Trainer's `bf16=True`); otherwise the
    /// moments are kept in the parameters' dtype, as `torch.optim.AdamW`
    /// keeps them.
    pub master_weights: bool,
}

/// Which AdamW a [`Trainer`] steps with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum OptimizerKind {
    /// Bastile's fused AdamW: one kernel per parameter, the clip folded in.
    Fused,
    /// Burn's AdamW (about fourteen element-wise ops per parameter) after a
    /// separate global-norm clip.
    #[default]
    Burn,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            learning_rate: 2e-5,
            warmup_steps: 0,
            total_steps: 1000,
            weight_decay: 0.0,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_epsilon: 1e-8,
            max_grad_norm: Some(1.0),
            optimizer: OptimizerKind::Burn,
            master_weights: false,
        }
    }
}

impl TrainConfig {
    /// HF's `get_cosine_schedule_with_warmup`: linear from 0 over the
    /// warmup, then half a cosine down to 0 at `total_steps`.
    pub fn lr_at(&self, step: usize) -> f64 {
        if step < self.warmup_steps {
            return self.learning_rate * step as f64 / self.warmup_steps.max(1) as f64;
        }
        let span = self.total_steps.saturating_sub(self.warmup_steps).max(1);
        let progress = ((step - self.warmup_steps) as f64 / span as f64).min(1.0);
        self.learning_rate * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
    }

    fn validate(&self) -> Result<(), ModelError> {
        let bad = |m: String| Err(ModelError::Config(m));
        if !(self.learning_rate.is_finite() && self.learning_rate >= 0.0) {
            return bad(format!(
                "learning_rate must be >= 0, got {}",
                self.learning_rate
            ));
        }
        if self.total_steps == 0 || self.warmup_steps > self.total_steps {
            return bad(format!(
                "need 0 <= warmup_steps ({}) <= total_steps ({}) and total_steps >= 1",
                self.warmup_steps, self.total_steps
            ));
        }
        if let Some(n) = self.max_grad_norm
            && !(n.is_finite() && n > 0.0)
        {
            return bad(format!("max_grad_norm must be positive, got {n}"));
        }
        if self.master_weights && self.optimizer != OptimizerKind::Fused {
            return bad("master weights need the fused AdamW".into());
        }
        Ok(())
    }

    fn fused(&self) -> FusedAdamWConfig {
        FusedAdamWConfig::new()
            .with_betas(self.adam_beta1.into(), self.adam_beta2.into())
            .with_epsilon(self.adam_epsilon.into())
            .with_weight_decay(self.weight_decay.into())
            .with_max_grad_norm(self.max_grad_norm.map(f64::from))
            .with_moments(MomentDtype::Param)
            .with_master_weights(self.master_weights)
    }
}

/// One micro-batch: token ids and (unshifted) labels, `[batch, seq]`.
pub struct MicroBatch<B: AutodiffBackend> {
    pub ids: Tensor<B, 2, Int>,
    pub labels: Tensor<B, 2, Int>,
}

/// What an optimizer step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepOutput {
    /// The mean loss over every counted token of the step's micro-batches.
    pub loss: f64,
    /// Tokens that counted (labels not ignored, after the shift).
    pub tokens: usize,
    pub learning_rate: f64,
}

/// The optimizer a [`Trainer`] holds.
enum TrainOptimizer<B: AutodiffBackend + BastileBackend> {
    Fused(FusedAdamW<B>),
    Burn(OptimizerAdaptor<AdamW, CausalLm<B>, B>),
}

/// AdamW + schedule + accumulation state.
pub struct Trainer<B: AutodiffBackend + BastileBackend> {
    pub config: TrainConfig,
    optimizer: TrainOptimizer<B>,
    step: usize,
}

impl<B> Trainer<B>
where
    B: AutodiffBackend + BastileBackend,
    B::InnerBackend: BastileBackend,
{
    pub fn new(config: TrainConfig) -> Result<Self, ModelError> {
        config.validate()?;
        let optimizer = match config.optimizer {
            OptimizerKind::Fused => TrainOptimizer::Fused(
                config
                    .fused()
                    .init::<B>()
                    .map_err(|e| ModelError::Config(e.to_string()))?,
            ),
            OptimizerKind::Burn => TrainOptimizer::Burn(
                AdamWConfig::new()
                    .with_beta_1(config.adam_beta1)
                    .with_beta_2(config.adam_beta2)
                    .with_epsilon(config.adam_epsilon)
                    .with_weight_decay(config.weight_decay)
                    .init::<B, CausalLm<B>>(),
            ),
        };
        Ok(Self {
            config,
            optimizer,
            step: 0,
        })
    }

    /// Optimizer steps taken.
    pub fn steps(&self) -> usize {
        self.step
    }

    /// One optimizer step over `micro_batches` (gradient accumulation):
    /// each micro-batch's loss is normalized by the token count of all of
    /// them, so the step follows the mean over every counted token, as one
    /// large batch would.
    pub fn step(
        &mut self,
        model: CausalLm<B>,
        micro_batches: &[MicroBatch<B>],
    ) -> Result<(CausalLm<B>, StepOutput), ModelError>
    where
        CausalLm<B>: AutodiffModule<B>,
    {
        if micro_batches.is_empty() {
            return Err(ModelError::Config(
                "a step needs at least one micro-batch".into(),
            ));
        }
        let ignore = CrossEntropyOptions::default().ignore_index;
        // Counted tokens: labels after the shift (position 0 never counts),
        // read in one transfer for all micro-batches.
        let counts: Vec<Tensor<B, 1, Int>> = micro_batches
            .iter()
            .filter_map(|m| {
                let [_, s] = m.labels.dims();
                (s >= 2).then(|| {
                    let counted = m.labels.clone().narrow(1, 1, s - 1).not_equal_elem(ignore);
                    counted.int().sum()
                })
            })
            .collect();
        let tokens: usize = if counts.is_empty() {
            0
        } else {
            let counts = Tensor::cat(counts, 0).into_data().convert::<i64>();
            counts.iter::<i64>().sum::<i64>() as usize
        };
        let options = CrossEntropyOptions::default()
            .with_reduction(Reduction::Mean)
            .with_normalizer(tokens.max(1) as f64);
        let mut accumulator = GradientsAccumulator::new();
        // Each micro-batch's loss, detached, read together after the last.
        let mut losses = Vec::with_capacity(micro_batches.len());
        for m in micro_batches {
            let out = model.loss(m.ids.clone(), m.labels.clone(), options)?;
            losses.push(out.loss.clone().detach());
            let grads = GradientsParams::from_grads(out.loss.backward(), &model);
            accumulator.accumulate(&model, grads);
        }
        let losses = Tensor::cat(losses, 0).into_data().convert::<f64>();
        let loss = losses.iter::<f64>().sum::<f64>();
        let lr = self.config.lr_at(self.step);
        let grads = accumulator.grads();
        let model = match &mut self.optimizer {
            TrainOptimizer::Fused(adamw) => adamw.step(lr, model, grads),
            TrainOptimizer::Burn(adamw) => {
                let grads = match self.config.max_grad_norm {
                    Some(max) => clip_grad_norm(&model, grads, max),
                    None => grads,
                };
                adamw.step(lr, model, grads)
            }
        };
        self.step += 1;
        Ok((
            model,
            StepOutput {
                loss,
                tokens,
                learning_rate: lr,
            },
        ))
    }
}
