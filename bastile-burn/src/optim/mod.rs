//! [`AdamW`]: Burn's [`Optimizer`] on Bastile's fused step, for any Burn
//! module.
//!
//! A step is one global-norm reduction over every gradient and one fused
//! update that reads every parameter, its gradient and both moments once
//! and writes them back, each recorded as a single op over all parameters
//! (a few launches of many parameters each), instead of about fourteen
//! element-wise ops per parameter and a clip of its own. The parameters
//! keep their shapes through the step: nothing is reshaped on the way.
//! The math is `torch.optim.AdamW`'s (decoupled weight decay, bias
//! correction), in f32 whatever the storage dtypes, with
//! `clip_grad_norm_`'s global-norm clip folded in. On backends without the
//! kernels the same step runs as plain Burn ops.
//!
//! A step whose gradients hold a NaN or an infinity changes nothing
//! (parameters, master weights, moments); [`AdamW::last_norm`] gives the
//! step's gradient norm, on the device, for the caller to read and report
//! when it reads the loss.
//!
//! ```rust
//! use bastile::optim::AdamWConfig;
//! use burn::backend::{Autodiff, NdArray};
//! use burn::nn::LinearConfig;
//! use burn::optim::{GradientsParams, Optimizer};
//! use burn::tensor::{Distribution, Tensor};
//!
//! type B = Autodiff<NdArray>;
//! let device = Default::default();
//! let mut model = LinearConfig::new(8, 4).init::<B>(&device);
//! let mut optimizer = AdamWConfig::new().with_weight_decay(0.01).init::<B>()?;
//! for _ in 0..3 {
//!     let x = Tensor::<B, 2>::random([2, 8], Distribution::Default, &device);
//!     let loss = model.forward(x).powi_scalar(2).mean();
//!     let grads = GradientsParams::from_grads(loss.backward(), &model);
//!     model = optimizer.step(1e-3, model, grads);
//! }
//! let norm = optimizer.last_norm().expect("a step ran").into_scalar();
//! assert!(norm.is_finite());
//! # Ok::<(), bastile::BastileError>(())
//! ```

use burn::module::{AutodiffModule, ParamId};
use burn::optim::{GradientsParams, LearningRate, MultiGradientsParams, Optimizer};
use burn::record::Record;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Bool, DType, Tensor, TensorData, TensorMetadata};
// Burn implements `Record` for hashbrown's map.
use hashbrown::HashMap;

use crate::ops::adamw::{AdamWClip, AdamWStep, AdamWTensors, AdamWUpdate, flat};
use crate::ops::float;
use crate::{BastileBackend, BastileError};

mod walk;
use walk::{Gather, Put, Take};

/// The dtype the moments are kept in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum MomentDtype {
    /// The parameter's own dtype, as `torch.optim.AdamW` keeps them.
    #[default]
    Param,
    /// f32, whatever the parameter's dtype.
    F32,
}

/// The settings of [`AdamW`]; the defaults are HF Trainer's.
#[derive(Clone, Debug, PartialEq)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub epsilon: f64,
    /// Decoupled weight decay (`p ← p·(1 − lr·λ)` before the update).
    pub weight_decay: f64,
    /// Clip the global gradient norm to this; `None` leaves the gradients
    /// as they are (the norm is still computed, to skip non-finite steps).
    pub max_grad_norm: Option<f64>,
    pub moments: MomentDtype,
    /// Keep an f32 master copy of every parameter that is not f32 and
    /// update that, the parameter receiving its rounding: mixed precision
    /// as HF Trainer's `bf16=True` runs it. Moments are then f32 too.
    pub master_weights: bool,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-8,
            weight_decay: 0.0,
            max_grad_norm: Some(1.0),
            moments: MomentDtype::Param,
            master_weights: false,
        }
    }
}

impl AdamWConfig {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn with_betas(mut self, beta1: f64, beta2: f64) -> Self {
        (self.beta1, self.beta2) = (beta1, beta2);
        self
    }

    pub fn with_epsilon(mut self, epsilon: f64) -> Self {
        self.epsilon = epsilon;
        self
    }

    pub fn with_weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = weight_decay;
        self
    }

    pub fn with_max_grad_norm(mut self, max_grad_norm: Option<f64>) -> Self {
        self.max_grad_norm = max_grad_norm;
        self
    }

    pub fn with_moments(mut self, moments: MomentDtype) -> Self {
        self.moments = moments;
        self
    }

    pub fn with_master_weights(mut self, master_weights: bool) -> Self {
        self.master_weights = master_weights;
        self
    }

    /// The step's hyper-parameters at `step` (from 1).
    fn hyper(&self, learning_rate: f64, step: u64) -> AdamWStep {
        AdamWStep {
            learning_rate,
            beta1: self.beta1,
            beta2: self.beta2,
            epsilon: self.epsilon,
            weight_decay: self.weight_decay,
            step,
        }
    }

    /// Whether a parameter of `dtype` has an f32 master copy, and the dtype
    /// of its moments.
    fn layout(&self, dtype: DType) -> (bool, DType) {
        let master = self.master_weights && dtype != DType::F32;
        let moments = if master || self.moments == MomentDtype::F32 {
            DType::F32
        } else {
            dtype
        };
        (master, moments)
    }

    /// The state of `weights` for this step: zero moments (and the master
    /// copy) before its first step; a loaded state in the dtypes the
    /// settings give, whatever precision its record was saved in.
    fn state<B: Backend>(
        &self,
        weights: &FloatTensor<B>,
        saved: Option<AdamWState<B>>,
    ) -> AdamWState<B> {
        let (master, moments) = self.layout(weights.dtype());
        match saved {
            Some(s) => AdamWState {
                moment1: s.moment1.cast(moments),
                moment2: s.moment2.cast(moments),
                master: s.master.map(|m| m.cast(DType::F32)),
            },
            None => {
                let weights = flat::<B>(weights.clone());
                let zeros = Tensor::zeros_like(&weights).cast(moments);
                AdamWState {
                    moment1: zeros.clone(),
                    moment2: zeros,
                    master: master.then(|| weights.clone().cast(DType::F32)),
                }
            }
        }
    }

    /// Checks the settings and makes the optimizer.
    pub fn init<B: AutodiffBackend>(&self) -> Result<AdamW<B>, BastileError>
    where
        B::InnerBackend: BastileBackend,
    {
        self.hyper(0.0, 1)
            .validate()
            .map_err(|e| BastileError::Config(format!("AdamW: {e}")))?;
        if let Some(max) = self.max_grad_norm
            && !(max.is_finite() && max > 0.0)
        {
            return Err(BastileError::Config(format!(
                "AdamW: max_grad_norm must be positive, got {max}"
            )));
        }
        Ok(AdamW {
            config: self.clone(),
            step: 0,
            states: HashMap::new(),
            last_norm: None,
            last_factors: None,
            next_factors: None,
        })
    }
}

/// One parameter's optimizer state, flat (`[numel]`).
#[derive(Record, Clone, Debug)]
pub struct AdamWState<B: Backend> {
    pub moment1: Tensor<B, 1>,
    pub moment2: Tensor<B, 1>,
    /// The f32 master weights (mixed precision).
    pub master: Option<Tensor<B, 1>>,
}

/// What [`AdamW`] saves and loads: the step count (the bias corrections
/// depend on it) and every parameter's state, as tensors of the training
/// backend `B`.
#[derive(Record, Clone)]
pub struct AdamWRecord<B: Backend> {
    pub step: u64,
    pub states: HashMap<ParamId, AdamWState<B>>,
}

/// The fused AdamW optimizer; see the [module](self) documentation.
#[derive(Clone)]
pub struct AdamW<B: AutodiffBackend> {
    config: AdamWConfig,
    step: u64,
    states: HashMap<ParamId, AdamWState<B::InnerBackend>>,
    last_norm: Option<Tensor<B::InnerBackend, 1>>,
    /// The device buffer the last update read its step's factors from.
    last_factors: Option<Tensor<B::InnerBackend, 1>>,
    /// Factors uploaded ahead of the step that reads them, with their
    /// values ([`AdamW::upload_next_factors`]).
    next_factors: Option<([f32; 3], Tensor<B::InnerBackend, 1>)>,
}

impl<B: AutodiffBackend> AdamW<B>
where
    B::InnerBackend: BastileBackend,
{
    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// Steps taken.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// The global gradient norm of the last step (before clipping), as a
    /// device tensor of one element: not finite when that step was skipped.
    /// Reading it waits for the step, so read it with the loss.
    pub fn last_norm(&self) -> Option<Tensor<B::InnerBackend, 1>> {
        self.last_norm.clone().map(|t| t.slice(1..2))
    }

    /// The device buffer (`[3]`, f32) the last step's update read its
    /// factors from ([`AdamWStep::factors`]: the step size, the decay and
    /// `1 / √(1 − β2ᵗ)`). A replay of that step's recorded GPU work
    /// (a CUDA graph) reads the same buffer: the caller writes the
    /// factors [`AdamW::count_replayed_step`] gives into it first.
    pub fn last_factors(&self) -> Option<Tensor<B::InnerBackend, 1>> {
        self.last_factors.clone()
    }

    /// Uploads the factors of the next step at learning rate `lr` now,
    /// before that step is queued; its update reads them from this buffer
    /// (which [`AdamW::last_factors`] then returns). A step recorded as a
    /// CUDA graph needs this: an upload inside the recording would be
    /// replayed with the recorded step's values.
    pub fn upload_next_factors(&mut self, lr: LearningRate, device: &B::Device) {
        let factors = self.config.hyper(lr, self.step + 1).factors();
        let tensor =
            Tensor::<B::InnerBackend, 1>::from_data(TensorData::new(factors.to_vec(), [3]), device);
        self.next_factors = Some((factors, tensor));
    }

    /// Counts a step that runs as a replay of recorded GPU work instead of
    /// through [`AdamW::step_unless`], at learning rate `lr`: the factors
    /// its update must find in [`AdamW::last_factors`].
    pub fn count_replayed_step(&mut self, lr: LearningRate) -> [f32; 3] {
        self.step += 1;
        self.config.hyper(lr, self.step).factors()
    }

    /// [`Optimizer::step`] that changes nothing when `skip` (one element,
    /// on the device) is true, without waiting for it: a training step
    /// passes the flags it computes on the device (a label out of range, a
    /// non-finite loss) and reads them with the loss at its end. The step
    /// still counts until [`AdamW::forget_skipped_step`].
    pub fn step_unless<M: AutodiffModule<B>>(
        &mut self,
        lr: LearningRate,
        module: M,
        mut grads: GradientsParams,
        skip: Tensor<B::InnerBackend, 1, Bool>,
    ) -> M {
        self.step_with(lr, module, &mut grads, Some(skip))
    }

    /// Takes back the count of the last step once the caller has read that
    /// it was skipped (its norm not finite, or its `skip` flag set), so the
    /// bias correction of the next steps counts only the steps applied.
    pub fn forget_skipped_step(&mut self) {
        self.step = self.step.saturating_sub(1);
    }

    fn step_with<M: AutodiffModule<B>>(
        &mut self,
        lr: LearningRate,
        module: M,
        grads: &mut GradientsParams,
        skip: Option<Tensor<B::InnerBackend, 1, Bool>>,
    ) -> M {
        // The parameters leave the module before the update is recorded, so
        // the update holds their only reference and writes them in place.
        let mut take = Take::<B> {
            grads,
            taken: Vec::new(),
        };
        let module = module.map(&mut take);
        let taken = take.taken;
        if taken.is_empty() {
            return module;
        }
        self.step += 1;
        let all: Vec<FloatTensor<B::InnerBackend>> = taken.iter().map(|t| t.grad.clone()).collect();
        let max_norm = self.config.max_grad_norm;
        let mut clip = B::InnerBackend::run(&AdamWClip { max_norm }, all);
        if let Some(skip) = skip {
            // A non-finite norm is what makes the update keep every value.
            let guarded: Tensor<B::InnerBackend, 1> = float(clip);
            clip = guarded
                .mask_fill(skip.expand([2]), f32::NAN)
                .into_primitive()
                .tensor();
        }
        self.last_norm = Some(float(clip.clone()));
        let hyper = self.config.hyper(lr, self.step);
        let factors = match self.next_factors.take() {
            Some((values, uploaded)) if values == hyper.factors() => uploaded,
            _ => {
                use burn::tensor::ops::FloatTensorOps;
                let device = B::InnerBackend::float_device(&taken[0].weights);
                Tensor::from_data(TensorData::new(hyper.factors().to_vec(), [3]), &device)
            }
        };
        self.last_factors = Some(factors.clone());
        let mut states = Vec::with_capacity(taken.len());
        let mut grads = Vec::with_capacity(taken.len());
        let mut order = Vec::with_capacity(taken.len());
        for t in taken {
            let saved = self.states.remove(&t.param.id);
            let state = self.config.state(&t.weights, saved);
            states.push(AdamWTensors {
                param: t.weights,
                moment1: state.moment1.into_primitive().tensor(),
                moment2: state.moment2.into_primitive().tensor(),
                master: state.master.map(|m| m.into_primitive().tensor()),
            });
            grads.push(t.grad);
            order.push(t.param);
        }
        let factors = factors.into_primitive().tensor();
        let updated =
            B::InnerBackend::run(&AdamWUpdate { hyper }, (states, grads, Some(clip), factors));
        let mut back = HashMap::with_capacity(order.len());
        for (param, updated) in order.into_iter().zip(updated) {
            self.states.insert(
                param.id,
                AdamWState {
                    moment1: float(updated.moment1),
                    moment2: float(updated.moment2),
                    master: updated.master.map(float),
                },
            );
            back.insert(param.id, (param, updated.param));
        }
        module.map(&mut Put::<B> { back })
    }
}
impl<B, M> Optimizer<M, B> for AdamW<B>
where
    B: AutodiffBackend,
    B::InnerBackend: BastileBackend,
    M: AutodiffModule<B>,
{
    type Record = AdamWRecord<B>;

    fn step(&mut self, lr: LearningRate, module: M, mut grads: GradientsParams) -> M {
        self.step_with(lr, module, &mut grads, None)
    }

    fn step_multi(&mut self, lr: LearningRate, module: M, mut grads: MultiGradientsParams) -> M {
        let mut gather = Gather {
            multi: &mut grads,
            into: GradientsParams::new(),
        };
        module.visit(&mut gather);
        let mut single = gather.into;
        self.step_with(lr, module, &mut single, None)
    }

    fn to_record(&self) -> Self::Record {
        let states = self
            .states
            .iter()
            .map(|(id, s)| {
                let state = AdamWState {
                    moment1: Tensor::from_inner(s.moment1.clone()),
                    moment2: Tensor::from_inner(s.moment2.clone()),
                    master: s.master.clone().map(Tensor::from_inner),
                };
                (*id, state)
            })
            .collect();
        AdamWRecord {
            step: self.step,
            states,
        }
    }

    fn load_record(mut self, record: Self::Record) -> Self {
        self.step = record.step;
        self.states = record
            .states
            .into_iter()
            .map(|(id, s)| {
                let state = AdamWState {
                    moment1: s.moment1.inner(),
                    moment2: s.moment2.inner(),
                    master: s.master.map(Tensor::inner),
                };
                (id, state)
            })
            .collect();
        self
    }
}
