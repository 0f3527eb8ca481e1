//! Token embedding lookup: the checked entry points, the reference math and
//! the ops' declarations; the lookup's autodiff node in `autodiff.rs`, the
//! gradient's kernel launch in `kernel.rs`.
//!
//! The forward pass is Burn's gather of the weight's rows. The backward
//! pass is where the op differs: Burn's node adds the rows' gradients into
//! a zeroed `[vocab, hidden]` tensor and autodiff then adds that tensor to
//! the gradient the weight already has, which with tied embeddings (the
//! output layer's gradient, registered earlier in the backward pass) holds
//! three `[vocab, hidden]` tensors at once. Bastile's node adds the rows
//! straight into the gradient already there, in place when nothing else
//! holds it: one `[vocab, hidden]` tensor. The addition is a kernel of
//! its own ([`bastile_cubecl::embedding`]): Burn's `select_add` walks the
//! tokens one after another.

mod autodiff;
mod kernel;

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Int, Shape, Tensor, TensorMetadata};

use crate::fused::{DTypeQuery, In, KernelBackend, Out, TensorSpec, fused_op};
use crate::ops::{cast_to, check_float, check_same_device, float};
use crate::patches::Op;
use crate::{BastileBackend, BastileError};

/// The rows of `weight` at `ids`: each token's embedding.
///
/// Ids must lie in `0..vocab`: they are not read back from the device
/// here (the models check each batch's ids once, before the forward
/// pass).
///
/// Errors when `weight` is not floating point or the tensors are on
/// different devices.
///
/// # Shapes
///
/// - `weight`: `[vocab, hidden]`
/// - `ids`: `[batch, seq]`
/// - output: `[batch, seq, hidden]`, in `weight`'s dtype
pub fn embedding<B: BastileBackend>(
    weight: Tensor<B, 2>,
    ids: Tensor<B, 2, Int>,
) -> Result<Tensor<B, 3>, BastileError> {
    check_float("the embedding weight", weight.dtype())?;
    check_same_device(
        "the embedding weight",
        &weight.device(),
        "ids",
        &ids.device(),
    )?;
    let input = (weight.into_primitive().tensor(), ids.into_primitive());
    Ok(float(B::run(&Embedding, input)))
}

/// `grad` with the embedding lookup's gradient added: row `ids[b, s]` of
/// `grad` gains `dout[b, s]` (in `grad`'s dtype, token by token), in place
/// when nothing else holds `grad`. Start from zeros for the lookup's
/// gradient alone, or from a tied output layer's gradient to add both
/// without a second `[vocab, hidden]` tensor.
///
/// Errors when the shapes do not match, a tensor is not floating point or
/// the tensors are on different devices.
///
/// # Shapes
///
/// - `grad`: `[vocab, hidden]`
/// - `ids`: `[batch, seq]`
/// - `dout`: `[batch, seq, hidden]`
/// - output: `[vocab, hidden]`
pub fn add_embedding_grad<B: BastileBackend>(
    grad: Tensor<B, 2>,
    ids: Tensor<B, 2, Int>,
    dout: Tensor<B, 3>,
) -> Result<Tensor<B, 2>, BastileError> {
    check_float("the embedding gradient", grad.dtype())?;
    check_float("the embedding output gradient", dout.dtype())?;
    let ([batch, seq], [_, hidden]) = (ids.dims(), grad.dims());
    if dout.dims() != [batch, seq, hidden] {
        return Err(BastileError::Shape(format!(
            "an embedding gradient [vocab, hidden] = {:?} takes ids [batch, seq] and an output \
             gradient [batch, seq, hidden], got ids {:?} and output gradient {:?}",
            grad.dims(),
            ids.dims(),
            dout.dims()
        )));
    }
    check_same_device(
        "the embedding gradient",
        &grad.device(),
        "ids",
        &ids.device(),
    )?;
    check_same_device(
        "the embedding gradient",
        &grad.device(),
        "the output gradient",
        &dout.device(),
    )?;
    let out = add_rows::<B>(
        grad.into_primitive().tensor(),
        ids.into_primitive(),
        dout.into_primitive().tensor(),
    );
    Ok(float(out))
}

/// `grad[ids[t]] += dout[t]` for every token `t`, in `grad`'s dtype, in
/// place when nothing else holds `grad`.
fn add_rows<B: BastileBackend>(
    grad: FloatTensor<B>,
    ids: IntTensor<B>,
    dout: FloatTensor<B>,
) -> FloatTensor<B> {
    let tokens = ids.shape().num_elements();
    let hidden = grad.shape()[1];
    let ids = B::int_reshape(ids, Shape::new([tokens]));
    let dout = cast_to::<B>(dout, grad.dtype());
    let dout = B::float_reshape(dout, Shape::new([tokens, hidden]));
    B::run(&EmbeddingGrad, (grad, dout, ids))
}

/// The lookup, with plain Burn ops.
fn lookup<B: Backend>((weight, ids): In<Embedding, B>) -> Out<Embedding, B> {
    B::embedding(weight, ids)
}

/// `(weight, ids)` to the rows of `weight` at `ids`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Embedding;

fused_op! {
    Embedding: Some(Op::Embedding), (F, I) => F, differentiable,
    |_, (weight, _)| -> DTypeQuery {
        (B::float_device(weight), DTypeQuery { dtype: weight.dtype() })
    }

    fn composite<B: Backend>(&self, input: In<Self, B>) -> Out<Self, B> {
        lookup::<B>(input)
    }

    fn kernels<K: KernelBackend>(&self, _: (), input: In<Self, K>) -> Out<Self, K> {
        lookup::<K>(input)
    }
}

/// `(grad, dout, ids)` to `grad` with row `ids[t]` gaining `dout[t]` for
/// every token (`grad` `[vocab, hidden]`, `dout` `[tokens, hidden]` in
/// `grad`'s dtype, `ids` `[tokens]`).
#[derive(Clone, Copy, Debug, Default)]
pub struct EmbeddingGrad;

fused_op! {
    EmbeddingGrad: Some(Op::Embedding), (F, F, I) => F,
    |_, (grad, _, _)| -> DTypeQuery {
        (B::float_device(grad), DTypeQuery { dtype: grad.dtype() })
    }

    fn composite<B: Backend>(&self, (grad, dout, ids): In<Self, B>) -> Out<Self, B> {
        B::float_select_add(grad, 0, ids, dout)
    }

    fn kernels<K: KernelBackend>(&self, _: (), (grad, dout, ids): In<Self, K>) -> Out<Self, K> {
        let spec = TensorSpec::of(&grad);
        let mut out = K::launch(self, vec![grad, dout], vec![ids], vec![spec]);
        out.pop().expect("the gradient")
    }
}
