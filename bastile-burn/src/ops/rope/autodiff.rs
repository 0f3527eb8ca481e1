//! RoPE's autodiff nodes: one per rotated tensor, whose backward is the
//! inverse rotation (nothing saved but the tables, which are constants).

use burn::tensor::ops::FloatTensor;
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};

use super::{Rope, RopeOptions};
use crate::BastileBackend;
use crate::fused::{In, Out, register_grads};

#[derive(Debug)]
struct Node;

impl<B: BastileBackend> Backward<B, 1> for Node {
    type State = (FloatTensor<B>, FloatTensor<B>, RopeOptions);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        register_grads::<B, _, _, 1>(ops, grads, |(cos, sin, options), d| {
            let inverse = Rope {
                options: RopeOptions {
                    inverse: !options.inverse,
                    ..options
                },
            };
            [B::run(&inverse, (d, None, cos, sin)).0]
        });
    }
}

/// One fused launch for q and k, then one node per output.
pub(super) fn forward<B: BastileBackend, C: CheckpointStrategy>(
    op: &Rope,
    (q, k, cos, sin): In<Rope, Autodiff<B, C>>,
) -> Out<Rope, Autodiff<B, C>> {
    let (cos, sin) = (cos.primitive, sin.primitive);
    let inner = (
        q.primitive.clone(),
        k.as_ref().map(|k| k.primitive.clone()),
        cos.clone(),
        sin.clone(),
    );
    let (q_out, k_out) = B::run(op, inner);
    let track = |input: &FloatTensor<Autodiff<B, C>>, out: FloatTensor<B>| match Node
        .prepare::<C>([input.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish((cos.clone(), sin.clone(), op.options), out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    };
    let q_out = track(&q, q_out);
    let k_out = match (k, k_out) {
        (Some(k), Some(out)) => Some(track(&k, out)),
        _ => None,
    };
    (q_out, k_out)
}
