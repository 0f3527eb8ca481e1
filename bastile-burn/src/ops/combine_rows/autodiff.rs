//! The combination's autodiff node: it keeps the rows, the weights and
//! both indices, and its backward pass computes the gradients of the
//! parents the graph tracks only.

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};

use super::{CombineRows, CombineRowsBackward};
use crate::BastileBackend;
use crate::fused::{In, Out, register_grads};

/// The node of the rows and the weights.
#[derive(Debug)]
struct Node;

impl<B: BastileBackend> Backward<B, 2> for Node {
    type State = (FloatTensor<B>, FloatTensor<B>, IntTensor<B>, IntTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let tracked = ops.parents.each_ref().map(Option::is_some);
        register_grads::<B, _, _, 2>(ops, grads, |state, dout: FloatTensor<B>| {
            let (rows, weights, row_of_slot, slot_of_row) = state;
            let op = CombineRowsBackward {
                rows_grad: tracked[0],
                weights_grad: tracked[1],
            };
            let (drows, dweights) = B::run(&op, (rows, weights, dout, row_of_slot, slot_of_row));
            [drows, dweights]
        });
    }
}

/// One node for the combination.
pub(super) fn forward<B: BastileBackend, C: CheckpointStrategy>(
    op: &CombineRows,
    (rows, weights, row_of_slot, slot_of_row): In<CombineRows, Autodiff<B, C>>,
) -> Out<CombineRows, Autodiff<B, C>> {
    let out = B::run(
        op,
        (
            rows.primitive.clone(),
            weights.primitive.clone(),
            row_of_slot.clone(),
            slot_of_row.clone(),
        ),
    );
    match Node
        .prepare::<C>([rows.node.clone(), weights.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let state = (rows.primitive, weights.primitive, row_of_slot, slot_of_row);
            prep.finish(state, out)
        }
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}
