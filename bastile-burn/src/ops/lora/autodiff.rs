//! The LoRA layer's autodiff node: compute-bound, it keeps its input
//! (through the checkpointer), the base weight, the adapters in the
//! input's dtype and the small `x · A`, and runs the fused backward; the
//! base weight's and bias's gradients only when they are trained.

use burn::tensor::TensorMetadata;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn_autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_autodiff::{Autodiff, NodeId};

use super::{Lora, LoraBackward};
use crate::BastileBackend;
use crate::fused::{In, Out, register_grads};

/// What the backward pass needs.
#[derive(Clone, Debug)]
struct State<B: Backend> {
    x: NodeId,
    weight: Option<FloatTensor<B>>,
    a: FloatTensor<B>,
    b: FloatTensor<B>,
    xa: FloatTensor<B>,
    op: LoraBackward,
}

/// The node of `P` parents: `x`, then the base weight and bias when the
/// layer has them, then `A` and `B`.
#[derive(Debug)]
struct Node<const P: usize>;

impl<B: BastileBackend, const P: usize> Backward<B, P> for Node<P> {
    type State = State<B>;

    fn backward(self, ops: Ops<State<B>, P>, grads: &mut Gradients, saved: &mut Checkpointer) {
        let x: FloatTensor<B> = saved.retrieve_node_output(ops.state.x);
        let trained = ops.parents.each_ref().map(Option::is_some);
        register_grads::<B, _, _, P>(ops, grads, |s: State<B>, dy| {
            let has_weight = s.weight.is_some();
            let inputs = (x.clone(), s.weight, s.a, s.b, s.xa, dy.clone());
            let (dx, da, db) = B::run(&s.op, inputs);
            let mut out = vec![Some(dx)];
            if has_weight {
                out.push(trained[1].then(|| B::linear_weight_backward(x, dy.clone())));
            }
            if P == 5 {
                out.push(trained[2].then(|| B::linear_bias_backward(dy)));
            }
            out.extend([Some(da), Some(db)]);
            out
        });
    }
}

/// One node for the forward pass; `x · A` and the cast adapters come back
/// untracked.
pub(super) fn forward<B: BastileBackend, C: CheckpointStrategy>(
    op: &Lora,
    (x, weight, bias, a, b): In<Lora, Autodiff<B, C>>,
) -> Out<Lora, Autodiff<B, C>> {
    let backward = LoraBackward {
        scale: op.scale,
        a_dtype: a.dtype(),
        b_dtype: b.dtype(),
    };
    let input = (
        x.primitive.clone(),
        weight.as_ref().map(|w| w.primitive.clone()),
        bias.as_ref().map(|b| b.primitive.clone()),
        a.primitive.clone(),
        b.primitive.clone(),
    );
    let (y, (xa, a_cast, b_cast)) = B::run(op, input);
    let state = |x: NodeId| State {
        x,
        weight: weight.as_ref().map(|w| w.primitive.clone()),
        a: a_cast.clone(),
        b: b_cast.clone(),
        xa: xa.clone(),
        op: backward,
    };
    let y = match (&weight, &bias) {
        (None, _) => node::<B, C, 3>([&x, &a, &b], &x, y, state),
        (Some(w), None) => node::<B, C, 4>([&x, w, &a, &b], &x, y, state),
        (Some(w), Some(bias)) => node::<B, C, 5>([&x, w, bias, &a, &b], &x, y, state),
    };
    let untracked = <Autodiff<B, C> as AutodiffBackend>::from_inner;
    (y, (untracked(xa), untracked(a_cast), untracked(b_cast)))
}

/// Records the node of `parents` for output `y`, its state built from the
/// checkpointed input's id.
fn node<B: BastileBackend, C: CheckpointStrategy, const P: usize>(
    parents: [&FloatTensor<Autodiff<B, C>>; P],
    x: &FloatTensor<Autodiff<B, C>>,
    y: FloatTensor<B>,
    state: impl FnOnce(NodeId) -> State<B>,
) -> FloatTensor<Autodiff<B, C>> {
    let parents = parents.map(|t| t.node.clone());
    match Node::<P>.prepare::<C>(parents).compute_bound().stateful() {
        OpsKind::Tracked(mut prep) => {
            let x = prep.checkpoint(x);
            prep.finish(state(x), y)
        }
        OpsKind::UnTracked(prep) => prep.finish(y),
    }
}
