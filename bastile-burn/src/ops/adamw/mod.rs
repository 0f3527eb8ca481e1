//! The fused optimizer's two ops: the global gradient norm with its clip
//! factor ([`AdamWClip`]), and the AdamW update of every parameter
//! ([`AdamWUpdate`]). The semantics are [`bastile_cubecl::adamw`]'s; the
//! composite versions here, in plain Burn ops, are what backends without
//! the kernels run. [`crate::optim::AdamW`] drives them. The kernel
//! launches are in `kernel.rs`.

mod kernel;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Device, Shape, Tensor, TensorMetadata};

pub use bastile_cubecl::adamw::AdamWStep;

use crate::fused::{DTypeQuery, FusedOp, In, KernelBackend, Out, TensorSpec, unpack};
use crate::ops::float;
use crate::patches::Op;
use kernel::{ClipLaunch, UpdateLaunch};

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

/// The global gradient norm and clip factor of a list of gradients (at
/// least one): `[scale, norm]`, f32 `[2]` (see [`composite_clip`]).
#[derive(Clone, Copy, Debug)]
pub struct AdamWClip {
    pub max_norm: Option<f64>,
}

/// The AdamW step of every parameter, from `(states, grads, clip)`: each
/// state (see [`AdamWTensors`]) with its gradient of `grads` (same order,
/// the parameter's shape) scaled by `clip[0]`; the whole step is skipped
/// when the norm `clip[1]` is not finite. Each parameter comes back in its
/// shape, its state flat.
#[derive(Clone, Copy, Debug)]
pub struct AdamWUpdate {
    pub hyper: AdamWStep,
}

/// Which of `dtypes` the element-wise kernels take on `device`, asked once
/// per distinct dtype.
fn kernel_dtypes<K: KernelBackend>(device: &Device<K>, dtypes: &[DType]) -> Vec<DType> {
    let mut asked: Vec<(DType, bool)> = Vec::new();
    for &dtype in dtypes {
        if !asked.iter().any(|(d, _)| *d == dtype) {
            let yes = K::ask(device, &DTypeQuery { dtype }).unwrap_or(false);
            asked.push((dtype, yes));
        }
    }
    asked
        .into_iter()
        .filter(|(_, yes)| *yes)
        .map(|(d, _)| d)
        .collect()
}

impl FusedOp for AdamWClip {
    // The optimizer is chosen explicitly; the switchboard lists the model's
    // ops only, so the clip follows the element-wise kernels' support.
    const PATCH: Option<Op> = None;
    type Input<F, I> = Vec<F>;
    type Output<F, I> = F;
    type Problem = Vec<DType>;
    type Plan = ();

    fn problem<B: Backend>(&self, grads: &In<Self, B>) -> (Device<B>, Vec<DType>) {
        let first = grads
            .first()
            .expect("the clip factor of at least one gradient");
        let dtypes = grads.iter().map(|g| g.dtype()).collect();
        (B::float_device(first), dtypes)
    }

    fn plan<K: KernelBackend>(&self, device: &Device<K>, dtypes: &Vec<DType>) -> Option<()> {
        let taken = kernel_dtypes::<K>(device, dtypes);
        dtypes.iter().all(|d| taken.contains(d)).then_some(())
    }

    fn composite<B: Backend>(&self, grads: In<Self, B>) -> Out<Self, B> {
        composite_clip::<B>(grads, self.max_norm)
    }

    fn kernels<K: KernelBackend>(&self, _: (), grads: In<Self, K>) -> Out<Self, K> {
        let outputs = vec![TensorSpec::new(Shape::new([2]), DType::F32)];
        let launch = ClipLaunch {
            max_norm: self.max_norm,
        };
        let [clip] = unpack(K::launch(&launch, grads, vec![], outputs));
        clip
    }
}

impl FusedOp for AdamWUpdate {
    const PATCH: Option<Op> = None;
    /// The states, the gradients, the clip factor and the step's factors
    /// (`[3]`, f32: [`AdamWStep::factors`], which the kernels read from the
    /// device and the composite path computes from `hyper`).
    type Input<F, I> = (Vec<AdamWTensors<F>>, Vec<F>, Option<F>, F);
    type Output<F, I> = Vec<AdamWTensors<F>>;
    /// The dtypes of each parameter, its gradient and its moments.
    type Problem = Vec<[DType; 3]>;
    /// Which parameters the kernels update (the others, of a dtype the
    /// kernels are not built for, run as plain ops in the same call).
    type Plan = Vec<bool>;

    fn problem<B: Backend>(
        &self,
        (states, grads, _, _): &In<Self, B>,
    ) -> (Device<B>, Vec<[DType; 3]>) {
        let device = states
            .first()
            .map(|s| B::float_device(&s.param))
            .unwrap_or_default();
        let dtypes = states
            .iter()
            .zip(grads)
            .map(|(s, g)| [s.param.dtype(), g.dtype(), s.moment1.dtype()])
            .collect();
        (device, dtypes)
    }

    fn plan<K: KernelBackend>(
        &self,
        device: &Device<K>,
        dtypes: &Vec<[DType; 3]>,
    ) -> Option<Vec<bool>> {
        let flat: Vec<DType> = dtypes.iter().flatten().copied().collect();
        let taken = kernel_dtypes::<K>(device, &flat);
        let fused: Vec<bool> = dtypes
            .iter()
            .map(|ds| ds.iter().all(|d| taken.contains(d)))
            .collect();
        fused.contains(&true).then_some(fused)
    }

    fn composite<B: Backend>(&self, (states, grads, clip, _): In<Self, B>) -> Out<Self, B> {
        composite_update_all::<B>(states, grads, clip, self.hyper)
    }

    fn kernels<K: KernelBackend>(&self, fused: Vec<bool>, input: In<Self, K>) -> Out<Self, K> {
        let (states, grads, clip, factors) = input;
        let (mut kernel, mut composite) = ((vec![], vec![]), (vec![], vec![]));
        for ((state, grad), &fused) in states.into_iter().zip(grads).zip(&fused) {
            let side = if fused { &mut kernel } else { &mut composite };
            side.0.push(state);
            side.1.push(grad);
        }
        let mut kernel = self
            .launch::<K>(kernel.0, kernel.1, clip.clone(), factors)
            .into_iter();
        let mut composite =
            composite_update_all::<K>(composite.0, composite.1, clip, self.hyper).into_iter();
        fused
            .into_iter()
            .map(|fused| {
                if fused {
                    kernel.next()
                } else {
                    composite.next()
                }
            })
            .map(|next| next.expect("one updated state per parameter"))
            .collect()
    }
}

impl AdamWUpdate {
    /// One launch over every state (3 or 4 tensors each), every gradient,
    /// the clip factor and the step's factors; the states come back in
    /// their order.
    fn launch<K: KernelBackend>(
        &self,
        states: Vec<AdamWTensors<FloatTensor<K>>>,
        grads: Vec<FloatTensor<K>>,
        clip: Option<FloatTensor<K>>,
        factors: FloatTensor<K>,
    ) -> Vec<AdamWTensors<FloatTensor<K>>> {
        if states.is_empty() {
            return Vec::new();
        }
        let sizes: Vec<usize> = states.iter().map(AdamWTensors::tensor_count).collect();
        let mut inputs: Vec<_> = states
            .into_iter()
            .flat_map(AdamWTensors::into_vec)
            .collect();
        let outputs = inputs.iter().map(TensorSpec::of).collect();
        let launch = UpdateLaunch {
            hyper: self.hyper,
            sizes: sizes.clone(),
            clipped: clip.is_some(),
        };
        inputs.extend(grads);
        inputs.extend(clip);
        inputs.push(factors);
        AdamWTensors::split(K::launch(&launch, inputs, vec![], outputs), &sizes)
    }
}
