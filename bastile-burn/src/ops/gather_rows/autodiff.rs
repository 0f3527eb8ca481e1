//! The row gather's autodiff node: it keeps the inverse index, and its
//! backward pass gathers the output rows' gradients back to their sources.

use burn::tensor::ops::IntTensor;
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};

use super::{GatherRows, GatherRowsBack};
use crate::BastileBackend;
use crate::fused::{In, Out};

#[derive(Debug)]
struct Node;

impl<B: BastileBackend> Backward<B, 1> for Node {
    /// `sources`: for every row of the input, the output rows copying it.
    type State = IntTensor<B>;

    fn backward(self, ops: Ops<IntTensor<B>, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dout = grads.consume::<B>(&ops.node);
        let [Some(parent)] = ops.parents else {
            return;
        };
        grads.register::<B>(parent.id, B::run(&GatherRowsBack, (dout, ops.state)));
    }
}

/// One node for the gather.
pub(super) fn forward<B: BastileBackend, C: CheckpointStrategy>(
    op: &GatherRows,
    (x, index, sources): In<GatherRows, Autodiff<B, C>>,
) -> Out<GatherRows, Autodiff<B, C>> {
    let out = B::run(op, (x.primitive.clone(), index, sources.clone()));
    match Node
        .prepare::<C>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(sources, out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}
