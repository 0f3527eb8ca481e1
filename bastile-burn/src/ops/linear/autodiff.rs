//! The linear layer's autodiff node: compute-bound, it keeps its input
//! (through the checkpointer) and the weight, and asks the fused backward
//! for the gradients of the parents the graph tracks only.

use burn::tensor::ops::FloatTensor;
use burn_autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_autodiff::{Autodiff, NodeId};

use super::{Linear, LinearBackward};
use crate::BastileBackend;
use crate::fused::{In, Out, register_grads};

/// The node of `P` parents: `x`, the weight and, when the layer has one,
/// the bias.
#[derive(Debug)]
struct Node<const P: usize>;

impl<B: BastileBackend, const P: usize> Backward<B, P> for Node<P> {
    type State = (NodeId, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, P>, grads: &mut Gradients, saved: &mut Checkpointer) {
        let x: FloatTensor<B> = saved.retrieve_node_output(ops.state.0);
        let trained = ops.parents.each_ref().map(Option::is_some);
        register_grads::<B, _, _, P>(ops, grads, |(_, weight), dy: FloatTensor<B>| {
            let op = LinearBackward {
                input_grad: trained[0],
                weight_grad: trained[1],
                bias_grad: P == 3 && trained[P - 1],
            };
            let (dx, dw, dbias) = B::run(&op, (x, weight, dy));
            [dx, dw, dbias]
        });
    }
}

/// One node for the forward pass.
pub(super) fn forward<B: BastileBackend, C: CheckpointStrategy>(
    op: &Linear,
    (x, weight, bias): In<Linear, Autodiff<B, C>>,
) -> Out<Linear, Autodiff<B, C>> {
    let input = (
        x.primitive.clone(),
        weight.primitive.clone(),
        bias.as_ref().map(|b| b.primitive.clone()),
    );
    let y = B::run(op, input);
    match &bias {
        None => node::<B, C, 2>([&x, &weight], &weight, y),
        Some(bias) => node::<B, C, 3>([&x, &weight, bias], &weight, y),
    }
}

fn node<B: BastileBackend, C: CheckpointStrategy, const P: usize>(
    parents: [&FloatTensor<Autodiff<B, C>>; P],
    weight: &FloatTensor<Autodiff<B, C>>,
    y: FloatTensor<B>,
) -> FloatTensor<Autodiff<B, C>> {
    let x = parents[0];
    match Node::<P>
        .prepare::<C>(parents.map(|t| t.node.clone()))
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(mut prep) => {
            let state = (prep.checkpoint(x), weight.primitive.clone());
            prep.finish(state, y)
        }
        OpsKind::UnTracked(prep) => prep.finish(y),
    }
}
