//! The router choice's autodiff node: it keeps the weights and the chosen
//! experts, and its backward pass is the softmax's, scattered to the
//! chosen logits.

use burn::tensor::TensorMetadata;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};

use super::{RouterTopK, backward};
use crate::BastileBackend;
use crate::fused::{In, Out};

#[derive(Debug)]
struct Node;

impl<B: BastileBackend> Backward<B, 1> for Node {
    /// The weights, the chosen experts and the expert count.
    type State = (FloatTensor<B>, IntTensor<B>, usize);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dweights = grads.consume::<B>(&ops.node);
        let [Some(parent)] = ops.parents else {
            return;
        };
        let (weights, chosen, experts) = ops.state;
        grads.register::<B>(parent.id, backward::<B>(weights, chosen, dweights, experts));
    }
}

/// One node for the choice; the chosen experts carry no gradient.
pub(super) fn forward<B: BastileBackend, C: CheckpointStrategy>(
    op: &RouterTopK,
    logits: In<RouterTopK, Autodiff<B, C>>,
) -> Out<RouterTopK, Autodiff<B, C>> {
    let experts = logits.primitive.shape()[1];
    let (weights, chosen) = B::run(op, logits.primitive.clone());
    let out = match Node
        .prepare::<C>([logits.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish((weights.clone(), chosen.clone(), experts), weights),
        OpsKind::UnTracked(prep) => prep.finish(weights),
    };
    (out, chosen)
}
