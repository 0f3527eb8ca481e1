//! The fused linear cross-entropy's autodiff nodes. With `Mean` / `Sum`
//! the gradients come out of the forward pass and the backward pass only
//! scales them by the upstream gradient; with `None` the backward pass
//! recomputes the chunks with the per-token upstream gradients.

use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, TensorMetadata};
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};

use super::{
    LinearCrossEntropy, LinearCrossEntropyBackward, LinearCrossEntropyWithGrads, LossSpec,
};
use crate::BastileBackend;
use crate::fused::{In, Out, register_grads};
use crate::ops::cross_entropy::{LossPair, Reduction};
use crate::ops::float;

/// Scales precomputed gradients by the upstream scalar gradient.
#[derive(Debug)]
struct ScaledNode<const P: usize>;

impl<B: BastileBackend, const P: usize> Backward<B, P> for ScaledNode<P> {
    type State = Vec<FloatTensor<B>>;

    fn backward(self, ops: Ops<Self::State, P>, grads: &mut Gradients, _: &mut Checkpointer) {
        register_grads::<B, _, _, P>(ops, grads, |saved, dloss| {
            let dloss = float::<B, 1>(dloss);
            saved.into_iter().map(move |g| {
                let factor = dloss.clone().cast(g.dtype());
                if g.shape().num_dims() == 1 {
                    (float::<B, 1>(g) * factor).into_primitive().tensor()
                } else {
                    (float::<B, 2>(g) * factor.reshape([1, 1]))
                        .into_primitive()
                        .tensor()
                }
            })
        });
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
struct DeferredNode<const P: usize>;

impl<B: BastileBackend, const P: usize> Backward<B, P> for DeferredNode<P> {
    type State = Saved<B>;

    fn backward(self, ops: Ops<Self::State, P>, grads: &mut Gradients, _: &mut Checkpointer) {
        register_grads::<B, _, _, P>(ops, grads, |s: Saved<B>, dloss| {
            let dloss = float::<B, 1>(dloss)
                .cast(DType::F32)
                .into_primitive()
                .tensor();
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
                let inputs = (hidden.clone(), weight.clone(), bias.clone(), labels.clone());
                let (loss, lse) = B::run(&forward, inputs);
                let saved = Saved {
                    hidden,
                    weight,
                    bias,
                    labels,
                    lse: lse.clone(),
                    spec,
                };
                (prep.finish(saved, loss), lse)
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
                let with_grads = LinearCrossEntropyWithGrads { spec };
                let ((loss, lse), g) = B::run(&with_grads, (hidden, weight, bias, labels));
                (prep.finish(g.into_vec(), loss), lse)
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
