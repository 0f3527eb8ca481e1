//! What the fused ops' autodiff nodes share.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn_autodiff::NodeId;
use burn_autodiff::checkpoint::retro_forward::RetroForward;
use burn_autodiff::checkpoint::state::BackwardStates;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::Ops;

/// The backward pass of a fused node with `N` parents: consumes the node's
/// output gradient, computes the parents' gradients from the saved state
/// (in parent order; a gradient may be `None` for a parent the graph does
/// not track, so that it is never computed) and registers those of the
/// parents the graph tracks.
pub(crate) fn register_grads<B, S, G, const N: usize>(
    ops: Ops<S, N>,
    grads: &mut Gradients,
    backward: impl FnOnce(S, FloatTensor<B>) -> G,
) where
    B: Backend,
    G: IntoIterator,
    G::Item: Into<Option<FloatTensor<B>>>,
{
    let dout = grads.consume::<B>(&ops.node);
    let parent_grads = backward(ops.state, dout);
    for (parent, grad) in ops.parents.into_iter().zip(parent_grads) {
        if let Some(parent) = parent {
            let grad = grad.into().expect("a tracked parent's gradient");
            grads.register::<B>(parent.id, grad);
        }
    }
}

/// The forward pass of a memory-bound fused node, recomputed from its
/// inputs: checkpointing (Burn's `BalancedCheckpointing`) may then drop the
/// node's output and rebuild it when a later backward pass needs it, as it
/// does for Burn's own element-wise ops.
pub(crate) struct Recompute<B: Backend, O> {
    inputs: Vec<NodeId>,
    op: O,
    forward: fn(&O, Vec<FloatTensor<B>>) -> FloatTensor<B>,
}

impl<B: Backend, O> Recompute<B, O> {
    /// `forward` runs `op` on the inputs' values, in the order of `inputs`.
    pub(crate) fn new(
        inputs: Vec<NodeId>,
        op: O,
        forward: fn(&O, Vec<FloatTensor<B>>) -> FloatTensor<B>,
    ) -> Self {
        Self {
            inputs,
            op,
            forward,
        }
    }
}

impl<B: Backend, O: core::fmt::Debug> core::fmt::Debug for Recompute<B, O> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "Recompute({:?} of {:?})", self.op, self.inputs)
    }
}

impl<B: Backend, O: core::fmt::Debug + Send + Sync + 'static> RetroForward for Recompute<B, O> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let inputs = self
            .inputs
            .iter()
            .map(|id| states.get_state::<FloatTensor<B>>(id))
            .collect();
        states.save(out_node, (self.forward)(&self.op, inputs));
    }
}
