//! `RotaryEncoding`: a drop-in for `burn::nn::RotaryEncoding` that runs
//! the fused RoPE kernel, with HF's `rotate_half` pairing by default and
//! the Llama 3 and YaRN scalings.

use burn::config::Config;
use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

use super::rope_frequencies::{RopeScaling, rope_frequencies};
use crate::ops::rope::{RopeLayout, RopeOptions, RopePairing, RopeTables, rope, rope_one};
use crate::{BastileBackend, BastileError};

/// Configuration, with `burn::nn::RotaryEncodingConfig`'s field names.
#[derive(Config, Debug)]
pub struct RotaryEncodingConfig {
    /// Positions the tables cover.
    pub max_sequence_length: usize,
    /// The rotated width (the head dimension).
    pub d_model: usize,
    /// The RoPE base (`rope_theta`; Qwen3 uses 1e6, Llama 3 5e5).
    #[config(default = "10000.0")]
    pub theta: f64,
    #[config(default = "RopeScaling::None")]
    pub scaling: RopeScaling,
    /// `Half` is HF's `rotate_half`; `Interleaved` is burn-nn's layout.
    #[config(default = "RopePairing::Half")]
    pub pairing: RopePairing,
}

impl RotaryEncodingConfig {
    /// Builds the tables on `device`.
    ///
    /// Errors on an odd `d_model`, a non-positive theta, zero positions or
    /// invalid scaling parameters.
    pub fn try_init<B: Backend>(
        &self,
        device: &B::Device,
    ) -> Result<RotaryEncoding<B>, BastileError> {
        if self.max_sequence_length == 0 {
            return Err(BastileError::Config(
                "RotaryEncoding needs max_sequence_length >= 1".into(),
            ));
        }
        let (inv_freq, scaling) = rope_frequencies(self.d_model, self.theta, &self.scaling)?;
        let tables = RopeTables::new(self.max_sequence_length, &inv_freq, scaling, device);
        Ok(RotaryEncoding {
            cos: tables.cos,
            sin: tables.sin,
            pairing: self.pairing,
        })
    }

    /// [`RotaryEncodingConfig::try_init`], panicking on an invalid config
    /// (as `burn::nn::RotaryEncodingConfig::init` does).
    pub fn init<B: Backend>(&self, device: &B::Device) -> RotaryEncoding<B> {
        self.try_init(device)
            .unwrap_or_else(|e| panic!("invalid RotaryEncodingConfig: {e}"))
    }
}

/// Precomputed cos/sin tables (constants, not parameters) and the pairing.
#[derive(Module, Debug)]
pub struct RotaryEncoding<B: Backend> {
    pub cos: Tensor<B, 3>,
    pub sin: Tensor<B, 3>,
    #[module(skip)]
    pub pairing: RopePairing,
}

impl<B: BastileBackend> RotaryEncoding<B> {
    /// The tables.
    pub fn tables(&self) -> RopeTables<B> {
        RopeTables {
            cos: self.cos.clone(),
            sin: self.sin.clone(),
        }
    }

    fn options(&self, layout: RopeLayout, offset: usize) -> RopeOptions {
        RopeOptions {
            layout,
            pairing: self.pairing,
            offset,
            inverse: false,
        }
    }

    /// burn-nn's call: rotates `x` (`[..., seq, d_model]`) from position 0.
    ///
    /// # Shapes
    ///
    /// - `x`: `[..., seq, d_model]`
    /// - output: the shape of `x`
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        self.apply(x, 0)
    }

    /// burn-nn's call: rotates `x` (`[..., seq, d_model]`) from position
    /// `start`. Panics on a shape the tables do not cover, as burn-nn does;
    /// [`RotaryEncoding::try_apply`] returns the error instead.
    pub fn apply<const D: usize>(&self, x: Tensor<B, D>, start: usize) -> Tensor<B, D> {
        self.try_apply(x, start)
            .unwrap_or_else(|e| panic!("RotaryEncoding: {e}"))
    }

    /// Rotates `x` (`[..., seq, d_model]`) from position `start`.
    pub fn try_apply<const D: usize>(
        &self,
        x: Tensor<B, D>,
        start: usize,
    ) -> Result<Tensor<B, D>, BastileError> {
        if D < 2 {
            return Err(BastileError::Shape(format!(
                "RotaryEncoding needs [..., seq, d_model], got rank {D}"
            )));
        }
        let dims = x.dims();
        let (seq, d) = (dims[D - 2], dims[D - 1]);
        let lead = dims[..D - 2].iter().product::<usize>();
        let x4 = x.reshape([lead, 1, seq, d]);
        let out = rope_one(x4, &self.tables(), self.options(RopeLayout::Bhsd, start))?;
        Ok(out.reshape(dims))
    }

    /// Rotates q and k together (one launch) from position `offset`.
    ///
    /// # Shapes
    ///
    /// - `q`: `[batch, q_heads, seq, head_dim]` or `[batch, seq, q_heads, head_dim]`, per `layout`
    /// - `k`: the same with `k_heads`
    /// - output: `(q, k)` in the shapes given
    pub fn forward_qk(
        &self,
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        layout: RopeLayout,
        offset: usize,
    ) -> Result<(Tensor<B, 4>, Tensor<B, 4>), BastileError> {
        rope(q, k, &self.tables(), self.options(layout, offset))
    }

    /// Rotates q and k by explicit `position_ids` (`[batch, seq]`), e.g.
    /// packed sequences that restart at 0.
    ///
    /// # Shapes
    ///
    /// - `q`, `k`: as [`RotaryEncoding::forward_qk`]
    /// - `position_ids`: `[batch, seq]`
    /// - output: `(q, k)` in the shapes given
    pub fn forward_qk_positions(
        &self,
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        layout: RopeLayout,
        position_ids: Tensor<B, 2, Int>,
    ) -> Result<(Tensor<B, 4>, Tensor<B, 4>), BastileError> {
        let tables = self.tables().gather(position_ids)?;
        rope(q, k, &tables, self.options(layout, 0))
    }
}
