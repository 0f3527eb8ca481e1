//! Linear layer + cross-entropy without the `[tokens, vocab]` logits: the
//! checked public entry point, the composite reference and the fused ops'
//! declarations; their autodiff nodes in `autodiff.rs`, the chunk loop in
//! `kernel.rs`.
//!
//! The loss is [`crate::cross_entropy`]'s of `hidden · weightᵀ (+ bias)`.
//! The fused path works over token chunks: each chunk's logits are computed,
//! turned into their gradient in place by the cross-entropy kernel, and
//! multiplied back into `d_hidden`; `d_weight` comes from the same chunk
//! when one covers every token, else (by default,
//! [`WeightGradSum::Chunks`](crate::WeightGradSum::Chunks)) from the
//! chunks' products summed in the weight's dtype, or, with
//! [`WeightGradSum::Exact`](crate::WeightGradSum::Exact), from a second
//! pass over vocabulary slices (see `kernel.rs`). The
//! extra memory is one chunk of logits.
//! With `Mean` / `Sum` the gradients are computed during the forward pass
//! (when anything requires them) and only scaled by the upstream gradient
//! in the backward pass, except an exact `d_weight` from several chunks:
//! the backward pass runs its pass over vocabulary slices, the upstream
//! gradient folded in. With `None` the backward pass recomputes the chunks
//! with the per-token upstream gradients.

mod autodiff;
pub(crate) mod kernel;

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Device, Distribution, Int, Shape, Tensor, TensorMetadata};

use crate::fused::{In, KernelBackend, Out, TensorSpec, fused_op};
use crate::ops::cross_entropy::{
    self, CrossEntropyOptions, CrossEntropyOutput, CrossEntropyQuery, LossPair, LossSpec,
    check_labels, check_tokens, output, spec,
};
use crate::ops::{check_float, check_same_device, f32_of, float, reduce_rows};
use crate::patches::Op;
use crate::{BastileBackend, BastileError};
use kernel::{ChunkLoop, Pass};

/// The gradients of a linear layer's parameters and input.
#[derive(Clone, Debug)]
pub struct LinearGrads<T> {
    pub hidden: T,
    pub weight: T,
    pub bias: Option<T>,
}

impl<T> LinearGrads<T> {
    /// From `[hidden, weight, bias?]`.
    pub fn from_vec(mut parts: Vec<T>, has_bias: bool) -> Self {
        let bias = if has_bias { parts.pop() } else { None };
        let weight = parts.pop().expect("weight gradient");
        Self {
            hidden: parts.pop().expect("hidden gradient"),
            weight,
            bias,
        }
    }
}

impl<T> LinearGrads<T> {
    /// `[hidden, weight, bias?]`, in that order.
    pub fn into_vec(self) -> Vec<T> {
        [Some(self.hidden), Some(self.weight), self.bias]
            .into_iter()
            .flatten()
            .collect()
    }
}

/// Cross-entropy of `hidden · weightᵀ (+ bias)` against `labels`, without
/// materializing the logits on backends that fuse it.
///
/// * `hidden`: `[N, H]`, `weight`: `[V, H]` (the `lm_head` layout),
///   `bias`: `[V]`, `labels`: `[N]` (already shifted for causal LM).
///
/// Errors on mismatched shapes, dtypes or devices, invalid options, and
/// labels outside `[0, V)` that are not the ignore index (the labels are
/// read once to check them and to count the tokens, unless
/// [`CrossEntropyOptions::defer_label_check`] hands the check back).
///
/// # Shapes
///
/// - `hidden`: `[N, H]`
/// - `weight`: `[V, H]`; `bias`: `[V]`
/// - `labels`: `[N]`
/// - output: [`CrossEntropyOutput`], its `loss` `[1]` (`Mean`, `Sum`) or `[N]` (`None`), its `lse` `[N]`
pub fn linear_cross_entropy<B: BastileBackend>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
    labels: Tensor<B, 1, Int>,
    options: CrossEntropyOptions,
) -> Result<CrossEntropyOutput<B>, BastileError> {
    check_float("hidden", hidden.dtype())?;
    let [n, h] = hidden.dims();
    let [vocab, wh] = weight.dims();
    if wh != h {
        return Err(BastileError::Shape(format!(
            "weight is [{vocab}, {wh}] but hidden rows have {h} features (weight must be [vocab, hidden])"
        )));
    }
    let dtypes = [Some(weight.dtype()), bias.as_ref().map(|b| b.dtype())];
    for (what, dtype) in ["weight", "bias"].into_iter().zip(dtypes) {
        if let Some(dtype) = dtype
            && dtype != hidden.dtype()
        {
            return Err(BastileError::DType(format!(
                "{what} is {dtype:?} but hidden is {:?}",
                hidden.dtype()
            )));
        }
    }
    if let Some(b) = &bias {
        let [bv] = b.dims();
        if bv != vocab {
            return Err(BastileError::Shape(format!(
                "bias has {bv} entries but weight has {vocab} rows"
            )));
        }
        check_same_device("hidden", &hidden.device(), "bias", &b.device())?;
    }
    check_tokens("hidden", n, vocab, &labels)?;
    check_same_device("hidden", &hidden.device(), "weight", &weight.device())?;
    check_same_device("hidden", &hidden.device(), "labels", &labels.device())?;
    let checked = check_labels(&labels, vocab, &options)?;
    let spec = spec(&options, checked.counted)?;
    let input = (
        hidden.into_primitive().tensor(),
        weight.into_primitive().tensor(),
        bias.map(|b| b.into_primitive().tensor()),
        labels.clone().into_primitive(),
    );
    let (loss, lse) = B::run(&LinearCrossEntropy { spec }, input);
    Ok(output(loss, lse, labels, &spec, checked, &options))
}

/// `hidden · weightᵀ (+ bias)` with plain Burn ops.
fn logits<B: Backend>(
    hidden: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
) -> Tensor<B, 2> {
    let logits = float::<B, 2>(hidden).matmul(float::<B, 2>(weight).transpose());
    match bias {
        Some(b) => {
            let b = float::<B, 1>(b);
            let [v] = b.dims();
            logits + b.reshape([1, v])
        }
        None => logits,
    }
}

/// Reference forward: `linear`, then the composite cross-entropy.
pub fn composite<B: Backend>(
    hidden: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    labels: IntTensor<B>,
    spec: LossSpec,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let logits = logits::<B>(hidden, weight, bias);
    cross_entropy::composite::<B>(logits.into_primitive().tensor(), labels, spec)
}

/// The linear layer's gradients from the logits gradient.
fn linear_grads<B: Backend>(
    hidden: FloatTensor<B>,
    weight: FloatTensor<B>,
    has_bias: bool,
    dlogits: FloatTensor<B>,
) -> LinearGrads<FloatTensor<B>> {
    let d = float::<B, 2>(dlogits);
    let dh = d.clone().matmul(float::<B, 2>(weight));
    let dw = d.clone().transpose().matmul(float::<B, 2>(hidden));
    let db = has_bias.then(|| d.sum_dim(0).flatten::<1>(0, 1));
    LinearGrads {
        hidden: dh.into_primitive().tensor(),
        weight: dw.into_primitive().tensor(),
        bias: db.map(|b| b.into_primitive().tensor()),
    }
}

/// Reference gradients for an upstream gradient `dloss` (`[1]` for `Mean`
/// / `Sum`, `[N]` for `None`), recomputing the logits.
pub fn composite_backward<B: Backend>(
    hidden: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    labels: IntTensor<B>,
    lse: FloatTensor<B>,
    dloss: FloatTensor<B>,
    spec: LossSpec,
) -> LinearGrads<FloatTensor<B>> {
    let has_bias = bias.is_some();
    let logits = logits::<B>(hidden.clone(), weight.clone(), bias);
    let dlogits = cross_entropy::composite_backward::<B>(
        logits.into_primitive().tensor(),
        labels,
        lse,
        dloss,
        spec,
    );
    linear_grads::<B>(hidden, weight, has_bias, dlogits)
}

/// Reference forward with gradients (as for an upstream gradient of 1).
pub fn composite_with_grads<B: Backend>(
    hidden: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    labels: IntTensor<B>,
    spec: LossSpec,
) -> (LossPair<FloatTensor<B>>, LinearGrads<FloatTensor<B>>) {
    let (loss, lse) = composite::<B>(
        hidden.clone(),
        weight.clone(),
        bias.clone(),
        labels.clone(),
        spec,
    );
    let ones = B::float_ones(loss.shape(), &B::float_device(&loss), DType::F32.into());
    let grads = composite_backward::<B>(hidden, weight, bias, labels, lse.clone(), ones, spec);
    ((loss, lse), grads)
}

/// Cross-entropy of `hidden · weightᵀ (+ bias)` from `(hidden, weight,
/// bias, labels)`: `(loss, lse)`.
#[derive(Clone, Copy, Debug)]
pub struct LinearCrossEntropy {
    pub spec: LossSpec,
}

/// [`LinearCrossEntropy`] that also returns the gradients of the loss (for
/// an upstream gradient of 1).
#[derive(Clone, Copy, Debug)]
pub struct LinearCrossEntropyWithGrads {
    pub spec: LossSpec,
}

/// [`LinearCrossEntropy`] that also returns the gradients of the loss (for
/// an upstream gradient of 1) for the input and the bias, not for the
/// weight: `((loss, lse), (d_hidden, d_bias))`. The weight's gradient is
/// [`LinearCrossEntropyWeightGrad`]'s, once the upstream gradient is known.
#[derive(Clone, Copy, Debug)]
pub struct LinearCrossEntropyWithInputGrads {
    pub spec: LossSpec,
}

/// The gradients for an upstream gradient `dloss` (f32, `[1]` or `[N]`)
/// from `(hidden, weight, bias, labels, lse, dloss)`, recomputed from the
/// inputs and the forward's `lse`.
#[derive(Clone, Copy, Debug)]
pub struct LinearCrossEntropyBackward {
    pub spec: LossSpec,
}

/// [`LinearCrossEntropyBackward`]'s weight gradient alone, from the same
/// inputs.
#[derive(Clone, Copy, Debug)]
pub struct LinearCrossEntropyWeightGrad {
    pub spec: LossSpec,
}

/// The device and problem of a linear cross-entropy over `hidden`.
fn problem_of<B: Backend>(hidden: &FloatTensor<B>) -> (Device<B>, CrossEntropyQuery) {
    let query = CrossEntropyQuery {
        dtype: hidden.dtype(),
    };
    (B::float_device(hidden), query)
}

/// Runs the chunk loop of `pass`: the per-token `(losses, lse)` (stats
/// passes) followed by the gradients (gradient passes).
fn chunk_loop<K: KernelBackend>(
    spec: LossSpec,
    pass: Pass,
    (hidden, weight, bias, labels): (
        FloatTensor<K>,
        FloatTensor<K>,
        Option<FloatTensor<K>>,
        IntTensor<K>,
    ),
    extra: Vec<FloatTensor<K>>,
) -> Vec<FloatTensor<K>> {
    let mut outputs = Vec::new();
    if pass.returns_stats() {
        let per_token = TensorSpec::new(Shape::new([hidden.shape()[0]]), DType::F32);
        outputs.extend([per_token.clone(), per_token]);
    }
    let grads = [
        pass.returns_input_grads().then_some(&hidden),
        pass.returns_weight_grad().then_some(&weight),
        bias.as_ref().filter(|_| pass.returns_input_grads()),
    ];
    outputs.extend(grads.into_iter().flatten().map(TensorSpec::of));
    let kernel = ChunkLoop {
        spec,
        pass,
        has_bias: bias.is_some(),
    };
    let floats = [Some(hidden), Some(weight), bias]
        .into_iter()
        .flatten()
        .chain(extra)
        .collect();
    K::launch(&kernel, floats, vec![labels], outputs)
}

fused_op! {
    LinearCrossEntropy: Some(Op::LinearCrossEntropy), (F, F, Option<F>, I) => LossPair<F>, differentiable,
    |_, (hidden, ..)| -> CrossEntropyQuery { problem_of::<B>(hidden) }

    fn composite<B: Backend>(&self, (hidden, weight, bias, labels): In<Self, B>) -> Out<Self, B> {
        composite::<B>(hidden, weight, bias, labels, self.spec)
    }

    fn kernels<K: KernelBackend>(&self, _: (), input: In<Self, K>) -> Out<Self, K> {
        let mut out = chunk_loop::<K>(self.spec, Pass::Stats, input, vec![]).into_iter();
        let rows = out.next().expect("the per-token losses");
        let lse = out.next().expect("the per-token lse");
        (reduce_rows::<K>(rows, &self.spec), lse)
    }
}

fused_op! {
    LinearCrossEntropyWithGrads: Some(Op::LinearCrossEntropy),
    (F, F, Option<F>, I) => (LossPair<F>, LinearGrads<F>),
    |_, (hidden, ..)| -> CrossEntropyQuery { problem_of::<B>(hidden) }

    fn composite<B: Backend>(&self, (hidden, weight, bias, labels): In<Self, B>) -> Out<Self, B> {
        composite_with_grads::<B>(hidden, weight, bias, labels, self.spec)
    }

    fn kernels<K: KernelBackend>(&self, _: (), input: In<Self, K>) -> Out<Self, K> {
        let has_bias = input.2.is_some();
        let mut out = chunk_loop::<K>(self.spec, Pass::StatsAndGrads, input, vec![]);
        let grads = LinearGrads::from_vec(out.split_off(2), has_bias);
        let lse = out.pop().expect("the per-token lse");
        let rows = out.pop().expect("the per-token losses");
        ((reduce_rows::<K>(rows, &self.spec), lse), grads)
    }
}

fused_op! {
    LinearCrossEntropyWithInputGrads: Some(Op::LinearCrossEntropy),
    (F, F, Option<F>, I) => (LossPair<F>, (F, Option<F>)),
    |_, (hidden, ..)| -> CrossEntropyQuery { problem_of::<B>(hidden) }

    fn composite<B: Backend>(&self, (hidden, weight, bias, labels): In<Self, B>) -> Out<Self, B> {
        let (loss, grads) = composite_with_grads::<B>(hidden, weight, bias, labels, self.spec);
        (loss, (grads.hidden, grads.bias))
    }

    fn kernels<K: KernelBackend>(&self, _: (), input: In<Self, K>) -> Out<Self, K> {
        let has_bias = input.2.is_some();
        let mut out = chunk_loop::<K>(self.spec, Pass::StatsAndInputGrads, input, vec![]);
        let bias = if has_bias { out.pop() } else { None };
        let hidden = out.pop().expect("the input's gradient");
        let lse = out.pop().expect("the per-token lse");
        let rows = out.pop().expect("the per-token losses");
        ((reduce_rows::<K>(rows, &self.spec), lse), (hidden, bias))
    }
}

fused_op! {
    LinearCrossEntropyWeightGrad: Some(Op::LinearCrossEntropy),
    (F, F, Option<F>, I, F, F) => F,
    |_, (hidden, ..)| -> CrossEntropyQuery { problem_of::<B>(hidden) }

    fn composite<B: Backend>(&self, input: In<Self, B>) -> Out<Self, B> {
        let (hidden, weight, bias, labels, lse, dloss) = input;
        composite_backward::<B>(hidden, weight, bias, labels, lse, dloss, self.spec).weight
    }

    fn kernels<K: KernelBackend>(&self, _: (), input: In<Self, K>) -> Out<Self, K> {
        let (hidden, weight, bias, labels, lse, dloss) = input;
        let extra = vec![lse, f32_of::<K>(dloss)];
        let mut out =
            chunk_loop::<K>(self.spec, Pass::WeightGrad, (hidden, weight, bias, labels), extra);
        out.pop().expect("the weight's gradient")
    }
}

fused_op! {
    LinearCrossEntropyBackward: Some(Op::LinearCrossEntropy),
    (F, F, Option<F>, I, F, F) => LinearGrads<F>,
    |_, (hidden, ..)| -> CrossEntropyQuery { problem_of::<B>(hidden) }

    fn composite<B: Backend>(&self, input: In<Self, B>) -> Out<Self, B> {
        let (hidden, weight, bias, labels, lse, dloss) = input;
        composite_backward::<B>(hidden, weight, bias, labels, lse, dloss, self.spec)
    }

    fn kernels<K: KernelBackend>(&self, _: (), input: In<Self, K>) -> Out<Self, K> {
        let (hidden, weight, bias, labels, lse, dloss) = input;
        let has_bias = bias.is_some();
        let extra = vec![lse, f32_of::<K>(dloss)];
        let out = chunk_loop::<K>(self.spec, Pass::Grads, (hidden, weight, bias, labels), extra);
        LinearGrads::from_vec(out, has_bias)
    }
}

/// Compiles (and autotunes) the cross-entropy kernel and the chunk
/// matmuls for a small vocabulary.
pub(crate) fn warmup<B: BastileBackend>(device: &B::Device) {
    let (n, h, v) = (64, 64, 1024);
    let hidden = Tensor::<B, 2>::random([n, h], Distribution::Normal(0.0, 1.0), device);
    let weight = Tensor::<B, 2>::random([v, h], Distribution::Normal(0.0, 0.1), device);
    let labels = Tensor::<B, 1, Int>::arange(0..n as i64, device);
    let _ = linear_cross_entropy(hidden, weight, None, labels, Default::default());
    let _ = B::sync(device);
}
