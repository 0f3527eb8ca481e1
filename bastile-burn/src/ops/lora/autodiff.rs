//! The LoRA update's autodiff node: compute-bound, it keeps its input
//! (through the checkpointer), the adapters and the small `x · A`, and runs
//! the fused backward.

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;
use burn_autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_autodiff::{Autodiff, NodeId};

use super::{LoraUpdate, LoraUpdateBackward};
use crate::BastileBackend;
use crate::fused::{In, Out, register_grads};

/// What the backward pass needs: the input's node id, `A`, `B`, `x · A`
/// and the op.
type State<B> = (
    NodeId,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    LoraUpdate,
);

#[derive(Debug)]
struct Node;

impl<B: BastileBackend> Backward<B, 3> for Node {
    type State = State<B>;

    fn backward(self, ops: Ops<State<B>, 3>, grads: &mut Gradients, saved: &mut Checkpointer) {
        let x = saved.retrieve_node_output(ops.state.0);
        register_grads::<B, _, _, 3>(ops, grads, |(_, a, b, xa, op), dy| {
            let backward = LoraUpdateBackward { scale: op.scale };
            let (dx, da, db) = B::run(&backward, (x, a, b, xa, dy));
            [dx, da, db]
        });
    }
}

/// One node for the forward pass; `x · A` comes back untracked.
pub(super) fn forward<B: BastileBackend, C: CheckpointStrategy>(
    op: &LoraUpdate,
    (x, a, b): In<LoraUpdate, Autodiff<B, C>>,
) -> Out<LoraUpdate, Autodiff<B, C>> {
    let inputs = (
        x.primitive.clone(),
        a.primitive.clone(),
        b.primitive.clone(),
    );
    let (out, xa) = B::run(op, inputs);
    let out = match Node
        .prepare::<C>([x.node.clone(), a.node.clone(), b.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(mut prep) => {
            let state = (
                prep.checkpoint(&x),
                a.primitive,
                b.primitive,
                xa.clone(),
                *op,
            );
            prep.finish(state, out)
        }
        OpsKind::UnTracked(prep) => prep.finish(out),
    };
    (out, <Autodiff<B, C> as AutodiffBackend>::from_inner(xa))
}
