//! SwiGLU's autodiff nodes: memory-bound, they keep only the inputs
//! (through the checkpointer, which may recompute them) and run the fused
//! backward, which recomputes the activation.

use burn::tensor::ops::FloatTensor;
use burn_autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_autodiff::{Autodiff, NodeId};

use super::{GluTensors, SwiGlu, SwiGluBackward};
use crate::BastileBackend;
use crate::fused::{In, Out, Recompute, register_grads};

/// The node of separate gate and up tensors (two parents) or of one packed
/// gate+up tensor (one parent); the state is the inputs' node ids.
#[derive(Debug)]
struct Node<const P: usize>;

impl<B: BastileBackend, const P: usize> Backward<B, P> for Node<P> {
    type State = [NodeId; P];

    fn backward(self, ops: Ops<Self::State, P>, grads: &mut Gradients, saved: &mut Checkpointer) {
        let mut inputs: Vec<FloatTensor<B>> = ops
            .state
            .iter()
            .map(|id| saved.retrieve_node_output(*id))
            .collect();
        let input = GluTensors::take_from(P == 1, &mut inputs);
        register_grads::<B, _, _, P>(ops, grads, |_, dout| {
            B::run(&SwiGluBackward, (input, dout)).into_vec()
        });
    }
}

/// The node for `P` inputs (`[gate, up]` or `[gate_up]`).
fn node<B: BastileBackend, C: CheckpointStrategy, const P: usize>(
    inputs: [FloatTensor<Autodiff<B, C>>; P],
) -> FloatTensor<Autodiff<B, C>> {
    let ids = inputs.each_ref().map(|t| t.node.id).to_vec();
    let recompute = Recompute::<B, _>::new(ids, SwiGlu, |op, mut inputs| {
        let packed = inputs.len() == 1;
        B::run(op, GluTensors::take_from(packed, &mut inputs))
    });
    let prep = Node::<P>
        .prepare::<C>(inputs.each_ref().map(|t| t.node.clone()))
        .memory_bound()
        .retro_forward(recompute)
        .parents(&inputs)
        .stateful();
    let mut primitives: Vec<_> = inputs.iter().map(|t| t.primitive.clone()).collect();
    let out = B::run(&SwiGlu, GluTensors::take_from(P == 1, &mut primitives));
    match prep {
        OpsKind::Tracked(mut prep) => {
            let state = inputs.each_ref().map(|t| prep.checkpoint(t));
            prep.finish(state, out)
        }
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

/// One node for the forward pass.
pub(super) fn forward<B: BastileBackend, C: CheckpointStrategy>(
    _op: &SwiGlu,
    input: In<SwiGlu, Autodiff<B, C>>,
) -> Out<SwiGlu, Autodiff<B, C>> {
    match input {
        GluTensors::Separate { gate, up } => node::<B, C, 2>([gate, up]),
        GluTensors::Packed(both) => node::<B, C, 1>([both]),
    }
}
