//! SwiGLU modules: a drop-in for `burn::nn::SwiGlu` and the HF-named MLP
//! of Qwen3 / Llama (`gate_proj`, `up_proj`, `down_proj`), both running the
//! fused SwiGLU kernel.

use burn::config::Config;
use burn::module::{Initializer, Module};
use burn::nn::{Linear, LinearConfig, LinearLayout};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use crate::BastileBackend;
use crate::ops::swiglu::swiglu;

fn fused<B: BastileBackend, const D: usize>(gate: Tensor<B, D>, up: Tensor<B, D>) -> Tensor<B, D> {
    swiglu(gate, up).expect("two projections of one input have the same shape, dtype and device")
}

/// `burn::nn::SwiGluConfig`, field for field.
#[derive(Config, Debug)]
pub struct SwiGluConfig {
    pub d_input: usize,
    pub d_output: usize,
    #[config(default = false)]
    pub bias: bool,
    #[config(
        default = "Initializer::KaimingUniform { gain: 1.0 / 3.0f64.sqrt(), fan_out_only: false }"
    )]
    pub initializer: Initializer,
    #[config(default = "LinearLayout::Row")]
    pub layout: LinearLayout,
}

impl SwiGluConfig {
    pub fn init<B: Backend>(&self, device: &B::Device) -> SwiGlu<B> {
        let linear = || {
            LinearConfig::new(self.d_input, self.d_output)
                .with_bias(self.bias)
                .with_initializer(self.initializer.clone())
                .with_layout(self.layout)
                .init(device)
        };
        SwiGlu {
            linear_inner: linear(),
            linear_outer: linear(),
        }
    }
}

/// `silu(linear_inner(x)) · linear_outer(x)`, the record of `burn::nn::SwiGlu`.
#[derive(Module, Debug)]
pub struct SwiGlu<B: Backend> {
    pub linear_inner: Linear<B>,
    pub linear_outer: Linear<B>,
}

impl<B: BastileBackend> SwiGlu<B> {
    /// # Shapes
    ///
    /// - `input`: `[..., d_input]`
    /// - output: `[..., d_output]`
    pub fn forward<const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, D> {
        fused(
            self.linear_inner.forward(input.clone()),
            self.linear_outer.forward(input),
        )
    }
}

/// The Qwen3 / Llama MLP.
#[derive(Config, Debug)]
pub struct SwiGluMlpConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    /// HF `mlp_bias`.
    #[config(default = false)]
    pub bias: bool,
}

impl SwiGluMlpConfig {
    pub fn init<B: Backend>(&self, device: &B::Device) -> SwiGluMlp<B> {
        let linear = |i, o| LinearConfig::new(i, o).with_bias(self.bias).init(device);
        SwiGluMlp {
            gate_proj: linear(self.hidden_size, self.intermediate_size),
            up_proj: linear(self.hidden_size, self.intermediate_size),
            down_proj: linear(self.intermediate_size, self.hidden_size),
        }
    }
}

/// `down_proj(silu(gate_proj(x)) · up_proj(x))` with HF's parameter names.
#[derive(Module, Debug)]
pub struct SwiGluMlp<B: Backend> {
    pub gate_proj: Linear<B>,
    pub up_proj: Linear<B>,
    pub down_proj: Linear<B>,
}

impl<B: BastileBackend> SwiGluMlp<B> {
    /// # Shapes
    ///
    /// - `x`: `[..., hidden]`
    /// - output: `[..., hidden]`
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let h = fused(self.gate_proj.forward(x.clone()), self.up_proj.forward(x));
        self.down_proj.forward(h)
    }
}
