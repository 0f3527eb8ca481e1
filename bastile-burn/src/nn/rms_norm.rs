//! `RmsNorm`, a drop-in for `burn::nn::RmsNorm`.

use burn::config::Config;
use burn::module::{Initializer, Module, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use crate::{BastileBackend, BastileError, RmsNormCast, ops};

/// Configuration of [`RmsNorm`]; the fields of `burn::nn::RmsNormConfig`
/// plus the cast convention.
#[derive(Config, Debug)]
pub struct RmsNormConfig {
    /// The size of the normalized (last) dimension.
    pub d_model: usize,
    /// Added to the mean square for numerical stability.
    #[config(default = 1e-5)]
    pub epsilon: f64,
    /// Where the result is cast back to the input dtype: Qwen3/Llama or GPT-OSS.
    #[config(default = "RmsNormCast::Llama")]
    pub cast: RmsNormCast,
}

impl RmsNormConfig {
    /// Initializes the module with a weight of ones.
    ///
    /// Panics if `epsilon` is not positive and finite (as `burn::nn` does);
    /// [`RmsNormConfig::try_init`] returns the error instead.
    pub fn init<B: Backend>(&self, device: &B::Device) -> RmsNorm<B> {
        self.try_init(device).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Initializes the module, or says why the configuration is invalid.
    pub fn try_init<B: Backend>(&self, device: &B::Device) -> Result<RmsNorm<B>, BastileError> {
        if !(self.epsilon.is_finite() && self.epsilon > 0.0) {
            return Err(BastileError::Config(format!(
                "RmsNorm epsilon must be positive and finite, got {}",
                self.epsilon
            )));
        }
        if self.d_model == 0 {
            return Err(BastileError::Config(
                "RmsNorm d_model must be at least 1".into(),
            ));
        }
        Ok(RmsNorm {
            gamma: Initializer::Ones.init([self.d_model], device),
            epsilon: self.epsilon,
            cast: self.cast,
        })
    }
}

/// Root-mean-square normalization over the last dimension, with a learned
/// scale `gamma`; fused forward and backward under `Bastile<B>`.
#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    /// The learned scale, named as in `burn::nn::RmsNorm`.
    pub gamma: Param<Tensor<B, 1>>,
    /// Added to the mean square for numerical stability.
    pub epsilon: f64,
    /// The cast convention (not a parameter: not part of the record).
    #[module(skip)]
    pub cast: RmsNormCast,
}

impl<B: BastileBackend> RmsNorm<B> {
    /// Normalizes `x` over its last dimension.
    ///
    /// Panics with a descriptive message on a shape or dtype mismatch;
    /// [`RmsNorm::try_forward`] returns the error instead.
    ///
    /// # Shapes
    ///
    /// - `x`: `[..., hidden]`
    /// - output: `[..., hidden]`
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        self.try_forward(x).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Normalizes `x` over its last dimension, or says why it cannot.
    pub fn try_forward<const D: usize>(
        &self,
        x: Tensor<B, D>,
    ) -> Result<Tensor<B, D>, BastileError> {
        ops::rms_norm::rms_norm(x, self.gamma.val(), self.epsilon, self.cast)
    }
}
