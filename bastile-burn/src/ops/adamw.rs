//! The fused optimizer's two ops on primitives: the global gradient norm
//! with its clip factor, and one parameter's AdamW update. The semantics
//! are [`bastile_cubecl::adamw`]'s; the composite versions here, in plain
//! Burn ops, are what backends without the kernels run.
//! [`crate::optim::AdamW`] drives them.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape, Tensor, TensorMetadata};

pub use bastile_cubecl::adamw::AdamWStep;

use crate::ops::float;

/// A parameter, in its own shape, and its optimizer state, flat
/// (`[numel]`): the update is element-wise, so only the element count
/// matters, and the parameter keeps its shape through the step.
#[derive(Clone, Debug)]
pub struct AdamWTensors<T> {
    pub param: T,
    pub moment1: T,
    pub moment2: T,
    /// The f32 master copy of the parameter (mixed precision).
    pub master: Option<T>,
}

impl<T> AdamWTensors<T> {
    /// The tensors in a list: the parameter, both moments, then the master
    /// copy if there is one.
    pub fn into_vec(self) -> Vec<T> {
        let mut list = vec![self.param, self.moment1, self.moment2];
        list.extend(self.master);
        list
    }

    /// How many tensors [`AdamWTensors::into_vec`] gives.
    pub fn tensor_count(&self) -> usize {
        3 + self.master.is_some() as usize
    }

    /// The states of a list of [`AdamWTensors::into_vec`] lists, one after
    /// the other, of `sizes` tensors each.
    pub fn split(list: Vec<T>, sizes: &[usize]) -> Vec<Self> {
        let mut list = list.into_iter();
        sizes
            .iter()
            .map(|&n| Self::from_vec(list.by_ref().take(n).collect()))
            .collect()
    }

    /// The inverse of [`AdamWTensors::into_vec`].
    pub fn from_vec(list: Vec<T>) -> Self {
        let mut list = list.into_iter();
        let mut next = || list.next().expect("a parameter and two moments");
        let (param, moment1, moment2) = (next(), next(), next());
        Self {
            param,
            moment1,
            moment2,
            master: list.next(),
        }
    }
}

/// The guard `clip_grad_norm_` adds to the norm before dividing by it.
const NORM_GUARD: f64 = 1e-6;

/// `t` as a flat rank-1 tensor.
pub(crate) fn flat<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 1> {
    let n = t.shape().num_elements();
    float(B::float_reshape(t, Shape::new([n])))
}

/// `[scale, norm]` (f32 `[2]`): the global L2 norm of `grads` and the
/// factor `min(1, max_norm / (norm + 1e-6))` that clips it to `max_norm`
/// (1 without a bound). `grads` must not be empty.
pub fn composite_clip<B: Backend>(
    grads: Vec<FloatTensor<B>>,
    max_norm: Option<f64>,
) -> FloatTensor<B> {
    let total = grads
        .into_iter()
        .map(|g| flat::<B>(g).cast(DType::F32).square().sum())
        .reduce(|a, b| a + b)
        .expect("the clip factor of at least one gradient");
    let norm = total.sqrt();
    let scale = match max_norm {
        Some(max) => norm
            .clone()
            .add_scalar(NORM_GUARD)
            .recip()
            .mul_scalar(max)
            .clamp_max(1.0),
        None => norm.ones_like(),
    };
    Tensor::cat(vec![scale, norm], 0).into_primitive().tensor()
}

/// [`composite_update`] of every parameter, each with its gradient of
/// `grads` (same order).
pub fn composite_update_all<B: Backend>(
    params: Vec<AdamWTensors<FloatTensor<B>>>,
    grads: Vec<FloatTensor<B>>,
    clip: Option<FloatTensor<B>>,
    hyper: AdamWStep,
) -> Vec<AdamWTensors<FloatTensor<B>>> {
    params
        .into_iter()
        .zip(grads)
        .map(|(state, grad)| composite_update::<B>(state, grad, clip.clone(), hyper))
        .collect()
}

/// One AdamW step of `state` with the gradient `grad` (the parameter's
/// shape, or flat) scaled by `clip[0]`; when `clip[1]` (the global norm) is not
/// finite the state comes back unchanged. Arithmetic in f32.
pub fn composite_update<B: Backend>(
    state: AdamWTensors<FloatTensor<B>>,
    grad: FloatTensor<B>,
    clip: Option<FloatTensor<B>>,
    hyper: AdamWStep,
) -> AdamWTensors<FloatTensor<B>> {
    let shape = state.param.shape();
    let param = flat::<B>(state.param);
    let moment1 = flat::<B>(state.moment1);
    let moment2 = flat::<B>(state.moment2);
    let master = state.master.map(flat::<B>);
    let (param_dtype, moments_dtype) = (param.dtype(), moment1.dtype());
    let n = param.dims()[0];
    let mut g = flat::<B>(grad).cast(DType::F32);
    let mut finite = None;
    if let Some(clip) = clip {
        let clip = flat::<B>(clip);
        g = g * clip.clone().slice(0..1).expand([n]);
        // NaN and ±∞ both fail `< ∞`.
        finite = Some(clip.slice(1..2).lower_elem(f64::INFINITY).expand([n]));
    }
    let (b1, b2) = (hyper.beta1, hyper.beta2);
    let (bias1, bias2) = hyper.bias_corrections();
    let m = moment1.clone().cast(DType::F32).mul_scalar(b1) + g.clone().mul_scalar(1.0 - b1);
    let v = moment2.clone().cast(DType::F32).mul_scalar(b2) + g.square().mul_scalar(1.0 - b2);
    let weights = match &master {
        Some(master) => master.clone(),
        None => param.clone().cast(DType::F32),
    };
    let step = m
        .clone()
        .div_scalar(bias1)
        .div(v.clone().div_scalar(bias2).sqrt().add_scalar(hyper.epsilon));
    let decay = 1.0 - hyper.learning_rate * hyper.weight_decay;
    let weights = weights.mul_scalar(decay) - step.mul_scalar(hyper.learning_rate);
    // Where the norm is not finite every element keeps its old value.
    let keep = |new: Tensor<B, 1>, old: Tensor<B, 1>| match &finite {
        Some(finite) => old.mask_where(finite.clone(), new),
        None => new,
    };
    let out = |t: Tensor<B, 1>| t.into_primitive().tensor();
    AdamWTensors {
        param: B::float_reshape(out(keep(weights.clone().cast(param_dtype), param)), shape),
        moment1: out(keep(m.cast(moments_dtype), moment1)),
        moment2: out(keep(v.cast(moments_dtype), moment2)),
        master: master.map(|old| out(keep(weights, old))),
    }
}
