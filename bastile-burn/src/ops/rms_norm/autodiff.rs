//! RMSNorm's autodiff node: memory-bound, it keeps its inputs (through the
//! checkpointer, which may recompute them) and the per-row `rstd`, and runs
//! the fused backward.

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;
use burn_autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_autodiff::{Autodiff, NodeId};

use super::{RmsNorm, RmsNormBackward};
use crate::BastileBackend;
use crate::fused::{In, Out, Recompute, register_grads, unpack};

/// What the backward pass needs: the inputs' node ids, `rstd` and the op.
type State<B> = ([NodeId; 2], FloatTensor<B>, RmsNorm);

#[derive(Debug)]
struct Node;

impl<B: BastileBackend> Backward<B, 2> for Node {
    type State = State<B>;

    fn backward(self, ops: Ops<State<B>, 2>, grads: &mut Gradients, saved: &mut Checkpointer) {
        let [x, gamma] = ops.state.0.map(|id| saved.retrieve_node_output(id));
        register_grads::<B, _, _, 2>(ops, grads, |(_, rstd, op), dy| {
            let backward = RmsNormBackward { cast: op.cast };
            let (dx, dgamma) = B::run(&backward, (x, gamma, rstd, dy));
            [dx, dgamma]
        });
    }
}

/// One node for the forward pass; `rstd` comes back untracked.
pub(super) fn forward<B: BastileBackend, C: CheckpointStrategy>(
    op: &RmsNorm,
    (x, gamma): In<RmsNorm, Autodiff<B, C>>,
) -> Out<RmsNorm, Autodiff<B, C>> {
    let recompute = Recompute::<B, _>::new(vec![x.node.id, gamma.node.id], *op, |op, inputs| {
        let [x, gamma] = unpack(inputs);
        B::run(op, (x, gamma)).0
    });
    let (y, rstd) = match Node
        .prepare::<C>([x.node.clone(), gamma.node.clone()])
        .memory_bound()
        .retro_forward(recompute)
        .parents([&x, &gamma])
        .stateful()
    {
        OpsKind::Tracked(mut prep) => {
            let (y, rstd) = B::run(op, (x.primitive.clone(), gamma.primitive.clone()));
            let inputs = [prep.checkpoint(&x), prep.checkpoint(&gamma)];
            (prep.finish((inputs, rstd.clone(), *op), y), rstd)
        }
        OpsKind::UnTracked(prep) => {
            let (y, rstd) = B::run(op, (x.primitive, gamma.primitive));
            (prep.finish(y), rstd)
        }
    };
    (y, <Autodiff<B, C> as AutodiffBackend>::from_inner(rstd))
}
