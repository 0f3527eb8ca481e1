//! GEGLU's autodiff node: memory-bound, it keeps only its input (through
//! the checkpointer, which may recompute it) and runs the fused backward.

use burn::tensor::ops::FloatTensor;
use burn_autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_autodiff::{Autodiff, NodeId};

use super::{GegluOss, GegluOssBackward};
use crate::BastileBackend;
use crate::fused::{In, Out, Recompute, register_grads, unpack};

#[derive(Debug)]
struct Node;

impl<B: BastileBackend> Backward<B, 1> for Node {
    type State = (NodeId, GegluOss);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, saved: &mut Checkpointer) {
        let x = saved.retrieve_node_output::<FloatTensor<B>>(ops.state.0);
        register_grads::<B, _, _, 1>(ops, grads, |(_, op), dout| {
            let backward = GegluOssBackward {
                alpha: op.alpha,
                limit: op.limit,
            };
            [B::run(&backward, (x, dout))]
        });
    }
}

/// One node for the forward pass.
pub(super) fn forward<B: BastileBackend, C: CheckpointStrategy>(
    op: &GegluOss,
    x: In<GegluOss, Autodiff<B, C>>,
) -> Out<GegluOss, Autodiff<B, C>> {
    let recompute = Recompute::<B, _>::new(vec![x.node.id], *op, |op, inputs| {
        let [x] = unpack(inputs);
        B::run(op, x)
    });
    match Node
        .prepare::<C>([x.node.clone()])
        .memory_bound()
        .retro_forward(recompute)
        .parents([&x])
        .stateful()
    {
        OpsKind::Tracked(mut prep) => {
            let state = (prep.checkpoint(&x), *op);
            prep.finish(state, B::run(op, x.primitive))
        }
        OpsKind::UnTracked(prep) => prep.finish(B::run(op, x.primitive)),
    }
}
