//! Linear layer + cross-entropy without the `[tokens, vocab]` logits: the
//! checked public entry point, the composite reference and the autodiff
//! nodes of the fused op.
//!
//! The loss is [`crate::cross_entropy`]'s of `hidden · weightᵀ (+ bias)`.
//! The fused path works over token chunks: each chunk's logits are computed,
//! turned into their gradient in place by the cross-entropy kernel, and
//! multiplied back into `d_hidden` and an f32 `d_weight` accumulator, so
//! the extra memory is one chunk of logits plus the f32 weight gradient.
//! With `Mean` / `Sum` the gradients are computed during the forward pass
//! (when anything requires them) and only scaled by the upstream gradient
//! in the backward pass; with `None` the backward pass recomputes the
//! chunks with the per-token upstream gradients.

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Distribution, Int, Tensor, TensorMetadata};
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};

use crate::ops::cross_entropy::{
    self, CrossEntropyOptions, CrossEntropyOutput, LossPair, LossSpec, Reduction, check_labels,
    check_tokens, output, spec,
};
use crate::ops::{check_float, check_same_device, float};
use crate::{BastileBackend, BastileError};

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
pub fn fused_linear_cross_entropy<B: BastileBackend>(
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
    let (loss, lse) = B::linear_cross_entropy(
        hidden.into_primitive().tensor(),
        weight.into_primitive().tensor(),
        bias.map(|b| b.into_primitive().tensor()),
        labels.clone().into_primitive(),
        spec,
    );
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

/// Scales precomputed gradients by the upstream scalar gradient.
#[derive(Debug)]
struct ScaledBackward<const P: usize>;

impl<B: BastileBackend, const P: usize> Backward<B, P> for ScaledBackward<P> {
    type State = Vec<FloatTensor<B>>;

    fn backward(
        self,
        ops: Ops<Self::State, P>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let dloss = float::<B, 1>(grads.consume::<B>(&ops.node));
        for (node, g) in ops.parents.into_iter().zip(ops.state) {
            let Some(node) = node else { continue };
            let factor = dloss.clone().cast(g.dtype());
            let scaled = if g.shape().num_dims() == 1 {
                (float::<B, 1>(g) * factor).into_primitive().tensor()
            } else {
                (float::<B, 2>(g) * factor.reshape([1, 1]))
                    .into_primitive()
                    .tensor()
            };
            grads.register::<B>(node.id, scaled);
        }
    }
}

/// What the deferred backward pass recomputes from.
#[derive(Debug, Clone)]
struct Saved<B: Backend> {
    hidden: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    labels: IntTensor<B>,
    lse: FloatTensor<B>,
    spec: LossSpec,
}

/// Recomputes the chunks with per-token upstream gradients (`None`).
#[derive(Debug)]
struct DeferredBackward<const P: usize>;

impl<B: BastileBackend, const P: usize> Backward<B, P> for DeferredBackward<P> {
    type State = Saved<B>;

    fn backward(
        self,
        ops: Ops<Self::State, P>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let dloss = grads.consume::<B>(&ops.node);
        let s = ops.state;
        let dloss = float::<B, 1>(dloss)
            .cast(DType::F32)
            .into_primitive()
            .tensor();
        let g = B::linear_cross_entropy_backward(
            s.hidden, s.weight, s.bias, s.labels, s.lse, dloss, s.spec,
        );
        for (node, g) in ops.parents.into_iter().zip(g.into_vec()) {
            if let Some(node) = node {
                grads.register::<B>(node.id, g);
            }
        }
    }
}

/// Runs the node of `P` parents (hidden, weight and maybe bias).
fn node<B: BastileBackend, C: CheckpointStrategy, const P: usize>(
    parents: [&FloatTensor<Autodiff<B, C>>; P],
    hidden: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    labels: IntTensor<B>,
    spec: LossSpec,
) -> LossPair<FloatTensor<Autodiff<B, C>>> {
    let parents = parents.map(|t| t.node.clone());
    if spec.reduction == Reduction::None {
        return match DeferredBackward::<P>
            .prepare::<C>(parents)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (loss, lse) = B::linear_cross_entropy(
                    hidden.clone(),
                    weight.clone(),
                    bias.clone(),
                    labels.clone(),
                    spec,
                );
                let saved = Saved {
                    hidden,
                    weight,
                    bias,
                    labels,
                    lse: lse.clone(),
                    spec,
                };
                (
                    prep.finish(saved, loss),
                    <Autodiff<B, C> as AutodiffBackend>::from_inner(lse),
                )
            }
            OpsKind::UnTracked(prep) => {
                let (loss, lse) = B::linear_cross_entropy(hidden, weight, bias, labels, spec);
                (
                    prep.finish(loss),
                    <Autodiff<B, C> as AutodiffBackend>::from_inner(lse),
                )
            }
        };
    }
    match ScaledBackward::<P>
        .prepare::<C>(parents)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let ((loss, lse), g) =
                B::linear_cross_entropy_with_grads(hidden, weight, bias, labels, spec);
            (
                prep.finish(g.into_vec(), loss),
                <Autodiff<B, C> as AutodiffBackend>::from_inner(lse),
            )
        }
        OpsKind::UnTracked(prep) => {
            let (loss, lse) = B::linear_cross_entropy(hidden, weight, bias, labels, spec);
            (
                prep.finish(loss),
                <Autodiff<B, C> as AutodiffBackend>::from_inner(lse),
            )
        }
    }
}

/// `Autodiff<B>`'s fused linear cross-entropy: one node whose gradients
/// come from `B`'s chunked kernels; the composite graph (full logits) when
/// `B` does not fuse it.
pub(crate) fn autodiff<B: BastileBackend, C: CheckpointStrategy>(
    hidden: FloatTensor<Autodiff<B, C>>,
    weight: FloatTensor<Autodiff<B, C>>,
    bias: Option<FloatTensor<Autodiff<B, C>>>,
    labels: IntTensor<B>,
    spec: LossSpec,
) -> LossPair<FloatTensor<Autodiff<B, C>>> {
    let device = B::float_device(&hidden.primitive);
    if !B::linear_cross_entropy_fused(&device, hidden.primitive.dtype()) {
        return composite::<Autodiff<B, C>>(hidden, weight, bias, labels, spec);
    }
    match bias {
        Some(b) => node::<B, C, 3>(
            [&hidden, &weight, &b],
            hidden.primitive.clone(),
            weight.primitive.clone(),
            Some(b.primitive.clone()),
            labels,
            spec,
        ),
        None => node::<B, C, 2>(
            [&hidden, &weight],
            hidden.primitive.clone(),
            weight.primitive.clone(),
            None,
            labels,
            spec,
        ),
    }
}

/// Compiles (and autotunes) the cross-entropy kernel and the chunk
/// matmuls for a small vocabulary.
pub(crate) fn warmup<B: BastileBackend>(device: &B::Device) {
    let (n, h, v) = (64, 64, 1024);
    let hidden = Tensor::<B, 2>::random([n, h], Distribution::Normal(0.0, 1.0), device);
    let weight = Tensor::<B, 2>::random([v, h], Distribution::Normal(0.0, 0.1), device);
    let labels = Tensor::<B, 1, Int>::arange(0..n as i64, device);
    let _ = fused_linear_cross_entropy(hidden, weight, None, labels, Default::default());
    let _ = B::sync(device);
}
