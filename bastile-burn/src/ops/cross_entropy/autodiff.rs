//! Cross-entropy's autodiff node: saves the logits and the per-token `lse`
//! and runs the fused gradient kernel.

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};

use super::{CrossEntropy, CrossEntropyBackward, LossSpec};
use crate::BastileBackend;
use crate::fused::{In, Out, register_grads};

#[derive(Debug)]
struct Node;

impl<B: BastileBackend> Backward<B, 1> for Node {
    type State = (FloatTensor<B>, IntTensor<B>, FloatTensor<B>, LossSpec);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        register_grads::<B, _, _, 1>(ops, grads, |(logits, labels, lse, spec), dloss| {
            [B::run(
                &CrossEntropyBackward { spec },
                (logits, labels, lse, dloss),
            )]
        });
    }
}

/// One node for the loss; `lse` comes back untracked.
pub(super) fn forward<B: BastileBackend, C: CheckpointStrategy>(
    op: &CrossEntropy,
    (logits, labels): In<CrossEntropy, Autodiff<B, C>>,
) -> Out<CrossEntropy, Autodiff<B, C>> {
    let (loss, lse) = match Node
        .prepare::<C>([logits.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (loss, lse) = B::run(op, (logits.primitive.clone(), labels.clone()));
            let state = (logits.primitive, labels, lse.clone(), op.spec);
            (prep.finish(state, loss), lse)
        }
        OpsKind::UnTracked(prep) => {
            let (loss, lse) = B::run(op, (logits.primitive, labels));
            (prep.finish(loss), lse)
        }
    };
    (loss, <Autodiff<B, C> as AutodiffBackend>::from_inner(lse))
}
