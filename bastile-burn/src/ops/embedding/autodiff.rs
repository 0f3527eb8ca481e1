//! The embedding lookup's autodiff node: it keeps the ids and the weight
//! (a handle to the parameter, not a copy), and its backward pass adds the
//! rows' gradients into the gradient the weight already has.

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Shape, TensorMetadata};
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};

use super::{Embedding, add_rows};
use crate::BastileBackend;
use crate::fused::{In, Out};

/// The weight as the graph tracks it (its gradient is looked up by its
/// node) and the ids.
type State<B> = (FloatTensor<Autodiff<B>>, IntTensor<B>);

#[derive(Debug)]
struct Node;

impl<B: BastileBackend> Backward<B, 1> for Node {
    type State = State<B>;

    fn backward(self, ops: Ops<State<B>, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dout = grads.consume::<B>(&ops.node);
        let [Some(parent)] = ops.parents else {
            return;
        };
        let (weight, ids) = ops.state;
        // Taken out of the gradients, the earlier gradient (a tied output
        // layer's) is held only here, so the rows are added in place and
        // `register` finds nothing to add them to.
        let grad = grads.remove::<B>(&weight).unwrap_or_else(|| {
            let shape: Shape = weight.primitive.shape();
            let device = B::float_device(&weight.primitive);
            // Zeros made flat, then viewed as rows: contiguous, where CubeCL
            // pads a matrix's rows (2880 bf16 columns take 3072) and the
            // optimizer would copy the vocabulary-sized gradient back.
            let flat = Shape::new([shape.num_elements()]);
            let zeros = B::float_zeros(flat, &device, weight.primitive.dtype().into());
            B::float_reshape(zeros, shape)
        });
        grads.register::<B>(parent.id, add_rows::<B>(grad, ids, dout));
    }
}

/// One node for the lookup.
pub(super) fn forward<B: BastileBackend, C: CheckpointStrategy>(
    op: &Embedding,
    (weight, ids): In<Embedding, Autodiff<B, C>>,
) -> Out<Embedding, Autodiff<B, C>> {
    let out = B::run(op, (weight.primitive.clone(), ids.clone()));
    match Node
        .prepare::<C>([weight.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish((weight, ids), out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}
