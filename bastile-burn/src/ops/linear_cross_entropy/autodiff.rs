//! The fused linear cross-entropy's autodiff nodes. With `Mean` / `Sum`
//! the input's (and bias's) gradients come out of the forward pass and the
//! backward pass only scales them by the upstream gradient; so does the
//! weight's when the chunks' products give it (one chunk, or
//! [`WeightGradSum::Chunks`](crate::WeightGradSum::Chunks)), else the
//! backward pass computes it over vocabulary slices with the upstream
//! gradient folded in (the pass the forward would have run, without a
//! weight-sized multiply afterwards). With `None` the backward pass
//! recomputes the chunks with the per-token upstream gradients.

use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Tensor, TensorMetadata};
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};

use super::kernel::{chunk_rows, chunks_give_weight_grad};
use super::{
    LinearCrossEntropy, LinearCrossEntropyBackward, LinearCrossEntropyWeightGrad,
    LinearCrossEntropyWithGrads, LinearCrossEntropyWithInputGrads, LossSpec,
};
use crate::BastileBackend;
use crate::fused::{In, Out, register_grads};
use crate::ops::cross_entropy::{LossPair, Reduction};
use crate::ops::{f32_of, float};

/// `g` times the upstream scalar gradient `dloss`.
fn scaled<B: Backend>(g: FloatTensor<B>, dloss: &Tensor<B, 1>) -> FloatTensor<B> {
    let factor = dloss.clone().cast(g.dtype());
    if g.shape().num_dims() == 1 {
        (float::<B, 1>(g) * factor).into_primitive().tensor()
    } else {
        (float::<B, 2>(g) * factor.reshape([1, 1]))
            .into_primitive()
            .tensor()
    }
}

/// What the forward pass of a `Mean` / `Sum` loss leaves its backward pass.
#[derive(Debug, Clone)]
enum Precomputed<B: Backend> {
    /// Every gradient (`hidden, weight, bias?`), the weight's from the
    /// chunks' products.
    All(Vec<FloatTensor<B>>),
    /// The input's and the bias's gradients, and what the weight's is
    /// computed from.
    InputGrads {
        hidden: FloatTensor<B>,
        bias: Option<FloatTensor<B>>,
        saved: Saved<B>,
    },
}

/// Scales precomputed gradients by the upstream scalar gradient, and
/// computes the weight's when the forward pass did not.
#[derive(Debug)]
struct ScaledNode<const P: usize>;

impl<B: BastileBackend, const P: usize> Backward<B, P> for ScaledNode<P> {
    type State = Precomputed<B>;

    fn backward(self, ops: Ops<Self::State, P>, grads: &mut Gradients, _: &mut Checkpointer) {
        register_grads::<B, _, _, P>(ops, grads, |state, dloss| {
            let factor = float::<B, 1>(dloss.clone());
            match state {
                Precomputed::All(saved) => saved
                    .into_iter()
                    .map(|g| scaled::<B>(g, &factor))
                    .collect::<Vec<_>>(),
                Precomputed::InputGrads {
                    hidden,
                    bias,
                    saved: s,
                } => {
                    let op = LinearCrossEntropyWeightGrad { spec: s.spec };
                    let dloss = f32_of::<B>(dloss);
                    let weight = B::run(&op, (s.hidden, s.weight, s.bias, s.labels, s.lse, dloss));
                    [Some(scaled::<B>(hidden, &factor)), Some(weight)]
                        .into_iter()
                        .chain([bias.map(|b| scaled::<B>(b, &factor))])
                        .flatten()
                        .collect()
                }
            }
        });
    }
}

/// Whether the weight's gradient comes from the forward's own chunk
/// products ([`chunks_give_weight_grad`]), the largest allocation the
/// device allows taken as unbounded: a device that bounds the chunk more
/// computes the weight's gradient in its forward's second pass instead,
/// the same result.
fn weight_grad_in_forward(tokens: usize, vocab: usize, dtype: DType, spec: &LossSpec) -> bool {
    let chunk = chunk_rows(tokens, vocab, dtype.size(), u64::MAX, spec.chunk_size);
    chunks_give_weight_grad(spec, chunk, tokens)
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

impl<B: Backend> Saved<B> {
    fn new(
        (hidden, weight, bias, labels): In<LinearCrossEntropy, B>,
        lse: FloatTensor<B>,
        spec: LossSpec,
    ) -> Self {
        Self {
            hidden,
            weight,
            bias,
            labels,
            lse,
            spec,
        }
    }
}

/// Recomputes the chunks with per-token upstream gradients (`None`).
#[derive(Debug)]
struct DeferredNode<const P: usize>;

impl<B: BastileBackend, const P: usize> Backward<B, P> for DeferredNode<P> {
    type State = Saved<B>;

    fn backward(self, ops: Ops<Self::State, P>, grads: &mut Gradients, _: &mut Checkpointer) {
        register_grads::<B, _, _, P>(ops, grads, |s: Saved<B>, dloss| {
            let dloss = f32_of::<B>(dloss);
            let op = LinearCrossEntropyBackward { spec: s.spec };
            B::run(&op, (s.hidden, s.weight, s.bias, s.labels, s.lse, dloss)).into_vec()
        });
    }
}

/// Runs the node of `P` parents (hidden, weight and maybe bias).
fn node<B: BastileBackend, C: CheckpointStrategy, const P: usize>(
    parents: [&FloatTensor<Autodiff<B, C>>; P],
    (hidden, weight, bias, labels): In<LinearCrossEntropy, B>,
    spec: LossSpec,
) -> LossPair<FloatTensor<Autodiff<B, C>>> {
    let parents = parents.map(|t| t.node.clone());
    let forward = LinearCrossEntropy { spec };
    let (loss, lse) = if spec.reduction == Reduction::None {
        match DeferredNode::<P>
            .prepare::<C>(parents)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let inputs = (hidden, weight, bias, labels);
                let (loss, lse) = B::run(&forward, inputs.clone());
                (
                    prep.finish(Saved::new(inputs, lse.clone(), spec), loss),
                    lse,
                )
            }
            OpsKind::UnTracked(prep) => {
                let (loss, lse) = B::run(&forward, (hidden, weight, bias, labels));
                (prep.finish(loss), lse)
            }
        }
    } else {
        match ScaledNode::<P>
            .prepare::<C>(parents)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (tokens, vocab) = (hidden.shape()[0], weight.shape()[0]);
                if weight_grad_in_forward(tokens, vocab, hidden.dtype(), &spec) {
                    let with_grads = LinearCrossEntropyWithGrads { spec };
                    let ((loss, lse), g) = B::run(&with_grads, (hidden, weight, bias, labels));
                    (prep.finish(Precomputed::All(g.into_vec()), loss), lse)
                } else {
                    let with_grads = LinearCrossEntropyWithInputGrads { spec };
                    let inputs = (hidden, weight, bias, labels);
                    let ((loss, lse), (d_hidden, d_bias)) = B::run(&with_grads, inputs.clone());
                    let state = Precomputed::InputGrads {
                        hidden: d_hidden,
                        bias: d_bias,
                        saved: Saved::new(inputs, lse.clone(), spec),
                    };
                    (prep.finish(state, loss), lse)
                }
            }
            OpsKind::UnTracked(prep) => {
                let (loss, lse) = B::run(&forward, (hidden, weight, bias, labels));
                (prep.finish(loss), lse)
            }
        }
    };
    (loss, <Autodiff<B, C> as AutodiffBackend>::from_inner(lse))
}

/// One node whose gradients come from `B`'s chunked kernels.
pub(super) fn forward<B: BastileBackend, C: CheckpointStrategy>(
    op: &LinearCrossEntropy,
    (hidden, weight, bias, labels): In<LinearCrossEntropy, Autodiff<B, C>>,
) -> Out<LinearCrossEntropy, Autodiff<B, C>> {
    let spec = op.spec;
    let inner = (
        hidden.primitive.clone(),
        weight.primitive.clone(),
        bias.as_ref().map(|b| b.primitive.clone()),
        labels,
    );
    match &bias {
        Some(b) => node::<B, C, 3>([&hidden, &weight, b], inner, spec),
        None => node::<B, C, 2>([&hidden, &weight], inner, spec),
    }
}
