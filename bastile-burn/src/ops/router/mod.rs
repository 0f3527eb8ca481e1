//! A mixture of experts' router choice, the `k` largest logits of every
//! token and the softmax over them: the checked entry point, the composite
//! reference and the op's declaration; its autodiff node in `autodiff.rs`,
//! the kernel launch in `kernel.rs`.
//!
//! Burn's `topk` sorts on the host: it reads the logits back and waits for
//! the device, once per layer, while the device runs dry. The kernel picks
//! on the device (one unit per token), so a layer's router never stalls
//! the queue. The backward pass is the softmax's, scattered to the chosen
//! logits: `dlogits[e_j] = w_j · (dw_j − Σ_i w_i · dw_i)`.

mod autodiff;
mod kernel;

use burn::tensor::activation::softmax;
use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Element, Int, Shape, Tensor, TensorMetadata};

use crate::fused::{DTypeQuery, In, KernelBackend, Out, TensorSpec, fused_op, unpack};
use crate::ops::{cast_to, check_float, float};
use crate::patches::Op;
use crate::{BastileBackend, BastileError};

/// Every row's `k` largest `logits` and the softmax over them, as routers
/// of mixtures of experts (GPT-OSS, Mixtral) weigh their chosen experts:
/// `(weights, experts)`, largest first. The softmax is computed in f32 and
/// rounded once to the logits' dtype.
///
/// Ties go to the lower expert index on the fused path (Burn's host sort,
/// the composite path, does not promise an order among equal logits).
///
/// Errors when `logits` is not floating point or `k` is not in
/// `1..=experts`.
///
/// # Shapes
///
/// - `logits`: `[tokens, experts]`
/// - output: weights `[tokens, k]` in the logits' dtype, experts
///   `[tokens, k]`
pub fn router_top_k<B: BastileBackend>(
    logits: Tensor<B, 2>,
    k: usize,
) -> Result<(Tensor<B, 2>, Tensor<B, 2, Int>), BastileError> {
    check_float("the router logits", logits.dtype())?;
    let [_, experts] = logits.dims();
    if k == 0 || k > experts {
        return Err(BastileError::Shape(format!(
            "a router chooses 1 <= k <= experts of its logits [tokens, experts] = {:?}, got k {k}",
            logits.dims()
        )));
    }
    let (weights, chosen) = B::run(&RouterTopK { k }, logits.into_primitive().tensor());
    Ok((float(weights), Tensor::from_primitive(chosen)))
}

/// The logits' gradient `[tokens, experts]` from the weights `[tokens, k]`,
/// their gradient and the chosen experts, in f32 and then the weights'
/// dtype.
fn backward<B: Backend>(
    weights: FloatTensor<B>,
    chosen: IntTensor<B>,
    dweights: FloatTensor<B>,
    experts: usize,
) -> FloatTensor<B> {
    let dtype = weights.dtype();
    let [tokens, _] = weights.shape().dims();
    let (w, dw) = (
        cast_to::<B>(weights, DType::F32),
        cast_to::<B>(dweights, DType::F32),
    );
    let dot = B::float_sum_dim(B::float_mul(w.clone(), dw.clone()), 1);
    let dchosen = B::float_mul(w, B::float_sub(dw, dot));
    let zeros = B::float_zeros(
        Shape::new([tokens, experts]),
        &B::float_device(&dchosen),
        DType::F32.into(),
    );
    let dlogits = B::float_scatter_add(1, zeros, chosen, dchosen);
    cast_to::<B>(dlogits, dtype)
}

/// `logits` to the chosen experts' weights and indices.
#[derive(Clone, Copy, Debug)]
pub struct RouterTopK {
    pub k: usize,
}

fused_op! {
    RouterTopK: Some(Op::Moe), F => (F, I), differentiable,
    |_, logits| -> DTypeQuery {
        (B::float_device(logits), DTypeQuery { dtype: logits.dtype() })
    }

    fn composite<B: Backend>(&self, logits: In<Self, B>) -> Out<Self, B> {
        let (top, chosen) = float::<B, 2>(logits).topk_with_indices(self.k, 1);
        let dtype = top.dtype();
        let weights = softmax(top.cast(DType::F32), 1).cast(dtype);
        (weights.into_primitive().tensor(), chosen.into_primitive())
    }

    fn kernels<K: KernelBackend>(&self, _: (), logits: In<Self, K>) -> Out<Self, K> {
        let [tokens, _] = logits.shape().dims();
        let shape = Shape::new([tokens, self.k]);
        let weights = TensorSpec::new(shape.clone(), logits.dtype());
        let chosen = TensorSpec::new(shape, <K::IntElem as Element>::dtype());
        let (floats, ints) = K::launch_split(self, vec![logits], vec![], vec![weights], vec![chosen]);
        let ([weights], [chosen]) = (unpack(floats), unpack(ints));
        (weights, chosen)
    }
}
