//! Attention's autodiff node: saves the inputs, the output and the f32
//! log-sum-exp, and runs the fused backward (which recomputes the scores
//! block by block).

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};

use super::{Attention, AttentionBackward, AttentionSpec};
use crate::BastileBackend;
use crate::fused::{In, Out, register_grads};

/// What the backward pass recomputes from.
#[derive(Debug, Clone)]
struct Saved<B: BastileBackend> {
    tensors: In<Attention, B>,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    spec: AttentionSpec,
}

/// The node of `P` parents: q, k, v and maybe the sinks.
#[derive(Debug)]
struct Node<const P: usize>;

impl<B: BastileBackend, const P: usize> Backward<B, P> for Node<P> {
    type State = Saved<B>;

    fn backward(self, ops: Ops<Self::State, P>, grads: &mut Gradients, _: &mut Checkpointer) {
        register_grads::<B, _, _, P>(ops, grads, |s: Saved<B>, dout| {
            let op = AttentionBackward { spec: s.spec };
            let g = B::run(&op, (s.tensors, s.out, s.lse, dout));
            [g.q, g.k, g.v].into_iter().chain(g.sinks)
        });
    }
}

fn node<B: BastileBackend, C: CheckpointStrategy, const P: usize>(
    parents: [&FloatTensor<Autodiff<B, C>>; P],
    op: &Attention,
    tensors: In<Attention, B>,
) -> (FloatTensor<Autodiff<B, C>>, FloatTensor<B>) {
    let parents = parents.map(|t| t.node.clone());
    match Node::<P>.prepare::<C>(parents).compute_bound().stateful() {
        OpsKind::Tracked(prep) => {
            let (out, lse) = B::run(op, tensors.clone());
            let saved = Saved {
                tensors,
                out: out.clone(),
                lse: lse.clone(),
                spec: op.spec,
            };
            (prep.finish(saved, out), lse)
        }
        OpsKind::UnTracked(prep) => {
            let (out, lse) = B::run(op, tensors);
            (prep.finish(out), lse)
        }
    }
}

/// One node for the forward pass; `lse` comes back untracked.
pub(super) fn forward<B: BastileBackend, C: CheckpointStrategy>(
    op: &Attention,
    t: In<Attention, Autodiff<B, C>>,
) -> Out<Attention, Autodiff<B, C>> {
    let inner = super::AttentionTensors {
        q: t.q.primitive.clone(),
        k: t.k.primitive.clone(),
        v: t.v.primitive.clone(),
        sinks: t.sinks.as_ref().map(|s| s.primitive.clone()),
        key_lengths: t.key_lengths,
        doc_starts: t.doc_starts,
    };
    let (out, lse) = match &t.sinks {
        Some(s) => node::<B, C, 4>([&t.q, &t.k, &t.v, s], op, inner),
        None => node::<B, C, 3>([&t.q, &t.k, &t.v], op, inner),
    };
    (out, <Autodiff<B, C> as AutodiffBackend>::from_inner(lse))
}
