//! The three measurements every memory-bound op reports, Bastile against
//! Burn in the same run: forward, backward, and forward + backward through
//! `Autodiff` (what a training step pays).

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Distribution, Tensor, TensorPrimitive};

use crate::Args;
use crate::report::Report;
use crate::timing::median_seconds;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    Forward,
    Backward,
    Train,
}

impl Pass {
    fn label(self) -> &'static str {
        match self {
            Pass::Forward => "forward",
            Pass::Backward => "backward",
            Pass::Train => "fwd+bwd (autodiff)",
        }
    }
}

/// Minimal bytes of each pass (each input read once, each output written once).
pub struct Bytes {
    pub forward: u64,
    pub backward: u64,
}

/// What one case measures.
pub struct Case<'a> {
    pub op: &'a str,
    pub shape: String,
    pub dtype: DType,
    pub bytes: Bytes,
}

/// The results of one call, held until the device has finished the sample.
pub type Kept = Box<dyn std::any::Any>;

/// Times `run(pass, fused, i)` (call `i` of a pass; `fused` selects Bastile)
/// for every pass and both implementations, and records the rows.
pub fn measure<B: Backend>(
    device: &B::Device,
    args: &Args,
    report: &mut Report,
    case: &Case,
    run: impl Fn(Pass, bool, usize) -> Kept,
) {
    let iters = if args.tiny { 2 } else { 20 };
    let sync = || B::sync(device).expect("device sync");
    let dname = format!("{:?}", case.dtype).to_lowercase();
    for (name, fused) in [("bastile", true), ("burn", false)] {
        for pass in [Pass::Forward, Pass::Backward, Pass::Train] {
            let t = median_seconds(args.samples, iters, |i| run(pass, fused, i), sync);
            let bytes = match pass {
                Pass::Forward => case.bytes.forward,
                Pass::Backward => case.bytes.backward,
                Pass::Train => case.bytes.forward + case.bytes.backward,
            };
            report.push(case.op, &case.shape, &dname, pass.label(), name, t, bytes);
        }
    }
}

/// How many input sets keep one pass over them out of L2 (at least 2).
pub fn sets_for(args: &Args, set_bytes: u64) -> usize {
    if args.tiny {
        2
    } else {
        (256u64 << 20).div_ceil(set_bytes.max(1)).clamp(2, 8) as usize
    }
}

/// A random normal primitive of `dtype`.
pub fn random<B: Backend, const D: usize>(
    shape: [usize; D],
    std: f64,
    dtype: DType,
    device: &B::Device,
) -> FloatTensor<B> {
    Tensor::<B, D>::random(shape, Distribution::Normal(0.0, std), device)
        .cast(dtype)
        .into_primitive()
        .tensor()
}

/// A primitive as a tensor of `Autodiff<X>`.
pub fn tracked<X: Backend, const D: usize>(
    t: FloatTensor<X>,
) -> Tensor<burn::backend::Autodiff<X>, D> {
    Tensor::from_inner(Tensor::from_primitive(TensorPrimitive::Float(t))).require_grad()
}

/// The gradients of `inputs` after `loss.backward()`, to be kept.
pub fn grads_of<X: Backend, const D: usize>(
    loss: Tensor<burn::backend::Autodiff<X>, 1>,
    inputs: &[&Tensor<burn::backend::Autodiff<X>, D>],
) -> Kept {
    let grads = loss.backward();
    let kept: Vec<Option<Tensor<X, D>>> = inputs.iter().map(|t| t.grad(&grads)).collect();
    Box::new(kept)
}

/// A primitive as a constant tensor of `Autodiff<X>`.
pub fn constant<X: Backend, const D: usize>(
    t: FloatTensor<X>,
) -> Tensor<burn::backend::Autodiff<X>, D> {
    Tensor::from_inner(Tensor::from_primitive(TensorPrimitive::Float(t)))
}
