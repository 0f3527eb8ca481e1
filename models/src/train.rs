//! A reusable training step for [`CausalLm`]: forward, the fused linear
//! cross-entropy (labels shifted, `ignore_index` for padding and prompt),
//! backward, gradient accumulation over micro-batches, gradient clipping by
//! global norm and AdamW with a warmup + cosine learning-rate schedule.
//!
//! The optimizer is Bastile's fused AdamW ([`bastile::optim::AdamW`], the
//! clip folded in), or with [`OptimizerKind::Burn`] Burn's AdamW after a
//! global-norm clip. [`Trainer::save_state`] and [`Trainer::load_state`]
//! keep the optimizer's state and the step beside a checkpoint, so that a
//! stopped run resumes where it was. [`Trainer::with_step_graphs`] records
//! a step as CUDA graphs and replays it for the steps of its shape, which
//! takes the host out of short steps.

use bastile::optim::{AdamW as FusedAdamW, AdamWConfig as FusedAdamWConfig, MomentDtype};
use bastile::{BastileBackend, CrossEntropyOptions, LabelCheck, Reduction, WeightGradSum};
use burn::module::{AutodiffModule, Module, ModuleVisitor, Param};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{AdamW, AdamWConfig, GradientsAccumulator, GradientsParams, Optimizer};
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder, Recorder, RecorderError};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{BasicOps, Bool, Element, Int, Tensor};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::time::{Duration, Instant};

use crate::clip::clip_grad_norm;
use crate::model::{IdCheck, packed_labels};
use crate::parallel::{Cause, Peers, World, combine, shares};
use crate::{CausalLm, ModelError};

/// Optimizer and schedule settings (HF `TrainingArguments` names where
/// they exist).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    pub learning_rate: f64,
    pub warmup_steps: usize,
    /// Optimizer steps of the cosine schedule (it decays to 0 at the end).
    pub total_steps: usize,
    pub weight_decay: f32,
    pub adam_beta1: f32,
    pub adam_beta2: f32,
    pub adam_epsilon: f32,
    /// Clip the global gradient norm to this (`None`: no clipping).
    pub max_grad_norm: Option<f32>,
    pub optimizer: OptimizerKind,
    /// Fused AdamW only: f32 moments and an f32 master copy of every
    /// parameter that is not f32 (HF Trainer's `bf16=True`); otherwise the
    /// moments are kept in the parameters' dtype, as `torch.optim.AdamW`
    /// keeps them.
    pub master_weights: bool,
    /// How the fused loss sums the output layer's gradient over its chunks
    /// of tokens: chunk by chunk in the weight's dtype as Liger-Kernel does
    /// (`Chunks`, the default), or once in f32 after a second pass over
    /// the vocabulary (`Exact`: a fourth product over the logits).
    /// Configurations saved before the option existed read as `Exact`,
    /// the sum they trained with.
    #[serde(default = "weight_grad_sum_before_the_option")]
    pub loss_weight_grad_sum: WeightGradSum,
}

/// The loss's weight-gradient sum of a configuration saved without it.
fn weight_grad_sum_before_the_option() -> WeightGradSum {
    WeightGradSum::Exact
}

/// Which AdamW a [`Trainer`] steps with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// Bastile's fused AdamW: a few launches for all parameters, the clip
    /// folded in.
    #[default]
    Fused,
    /// Burn's AdamW (about fourteen element-wise ops per parameter) after a
    /// separate global-norm clip.
    Burn,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            learning_rate: 2e-5,
            warmup_steps: 0,
            total_steps: 1000,
            weight_decay: 0.0,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_epsilon: 1e-8,
            max_grad_norm: Some(1.0),
            optimizer: OptimizerKind::Fused,
            master_weights: false,
            loss_weight_grad_sum: WeightGradSum::Chunks,
        }
    }
}

impl TrainConfig {
    /// HF's `get_cosine_schedule_with_warmup`: linear from 0 over the
    /// warmup, then half a cosine down to 0 at `total_steps`.
    pub fn lr_at(&self, step: usize) -> f64 {
        if step < self.warmup_steps {
            return self.learning_rate * step as f64 / self.warmup_steps.max(1) as f64;
        }
        let span = self.total_steps.saturating_sub(self.warmup_steps).max(1);
        let progress = ((step - self.warmup_steps) as f64 / span as f64).min(1.0);
        self.learning_rate * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
    }

    fn validate(&self) -> Result<(), ModelError> {
        let bad = |m: String| Err(ModelError::Config(m));
        if !(self.learning_rate.is_finite() && self.learning_rate >= 0.0) {
            return bad(format!(
                "learning_rate must be >= 0, got {}",
                self.learning_rate
            ));
        }
        if self.total_steps == 0 || self.warmup_steps > self.total_steps {
            return bad(format!(
                "need 0 <= warmup_steps ({}) <= total_steps ({}) and total_steps >= 1",
                self.warmup_steps, self.total_steps
            ));
        }
        if let Some(n) = self.max_grad_norm
            && !(n.is_finite() && n > 0.0)
        {
            return bad(format!("max_grad_norm must be positive, got {n}"));
        }
        if self.master_weights && self.optimizer != OptimizerKind::Fused {
            return bad("master weights need the fused AdamW".into());
        }
        Ok(())
    }

    fn fused(&self) -> FusedAdamWConfig {
        FusedAdamWConfig::new()
            .with_betas(self.adam_beta1.into(), self.adam_beta2.into())
            .with_epsilon(self.adam_epsilon.into())
            .with_weight_decay(self.weight_decay.into())
            .with_max_grad_norm(self.max_grad_norm.map(f64::from))
            .with_moments(MomentDtype::Param)
            .with_master_weights(self.master_weights)
    }
}

/// One micro-batch: token ids and (unshifted) labels, `[batch, seq]`,
/// and for rows that pack several documents each token's place in its
/// document (see [`CausalLm::loss_packed`]).
#[derive(Clone, Debug)]
pub struct MicroBatch<B: AutodiffBackend> {
    pub ids: Tensor<B, 2, Int>,
    pub labels: Tensor<B, 2, Int>,
    pub positions: Option<Tensor<B, 2, Int>>,
}

/// What an optimizer step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepOutput {
    /// The mean loss over every counted token of the step's micro-batches.
    pub loss: f64,
    /// Tokens that counted (labels not ignored, after the shift).
    pub tokens: usize,
    pub learning_rate: f64,
    /// Host time spent queuing the step's work, without the wait for its
    /// results: when it nears the step's wall time, the host bounds the
    /// step, not the device.
    pub host_seconds: f64,
}

/// The optimizer a [`Trainer`] holds.
enum TrainOptimizer<B: AutodiffBackend + BastileBackend> {
    Fused(FusedAdamW<B>),
    Burn(OptimizerAdaptor<AdamW, CausalLm<B>, B>),
}

/// AdamW + schedule + accumulation state; with
/// [`Trainer::data_parallel`], worker 0 of several (see
/// [`crate::parallel`]).
pub struct Trainer<B: AutodiffBackend + BastileBackend> {
    pub config: TrainConfig,
    optimizer: TrainOptimizer<B>,
    step: usize,
    /// This worker's place among data-parallel workers.
    pub(crate) world: Option<World<B>>,
    /// The other workers, when this is worker 0.
    pub(crate) peers: Option<Peers<B>>,
    /// The recorded step, with [`Trainer::with_step_graphs`].
    graphs: Option<StepGraphs<B>>,
}

/// Plain steps of one shape a [`Trainer`] with step graphs takes before it
/// records one: the first compiles and tunes the kernels, the second
/// leaves the memory pools as every later step finds them.
const PLAIN_STEPS_BEFORE_RECORDING: usize = 2;

/// A [`Trainer`]'s recorded step ([`Trainer::with_step_graphs`]).
struct StepGraphs<B: AutodiffBackend> {
    /// Every op of the steps runs on this stream, whose memory pool holds
    /// nothing the program makes between steps.
    stream: bastile::graph::GraphStream,
    /// The micro-batch shapes of the last plain steps ([`batch_shapes`]),
    /// and how many in a row had them.
    shapes: Vec<([usize; 2], bool)>,
    same_shape_steps: usize,
    recorded: Option<Recorded<B>>,
    /// Why the step could not be recorded: later steps run plainly.
    refused: Option<String>,
}

/// One recorded step and the device tensors it reads and writes.
struct Recorded<B: AutodiffBackend> {
    graph: bastile::graph::StepGraph,
    /// The inputs the recording reads; each replay's micro-batches are
    /// copied into them.
    inputs: Vec<MicroBatch<B>>,
    /// The results the recording writes, read after each replay.
    results: StepResults<B>,
    norm: Option<Tensor<B, 1>>,
    /// The buffer the recorded update reads its step's factors from.
    factors: Tensor<B::InnerBackend, 1>,
    /// Where the recorded step reads and writes the model's parameters.
    parameters: Vec<u64>,
}

impl<B> Trainer<B>
where
    B: AutodiffBackend + BastileBackend,
    B::InnerBackend: BastileBackend,
{
    pub fn new(config: TrainConfig) -> Result<Self, ModelError> {
        config.validate()?;
        let optimizer = match config.optimizer {
            OptimizerKind::Fused => TrainOptimizer::Fused(
                config
                    .fused()
                    .init::<B>()
                    .map_err(|e| ModelError::Config(e.to_string()))?,
            ),
            OptimizerKind::Burn => TrainOptimizer::Burn(
                AdamWConfig::new()
                    .with_beta_1(config.adam_beta1)
                    .with_beta_2(config.adam_beta2)
                    .with_epsilon(config.adam_epsilon)
                    .with_weight_decay(config.weight_decay)
                    .init::<B, CausalLm<B>>(),
            ),
        };
        Ok(Self {
            config,
            optimizer,
            step: 0,
            world: None,
            peers: None,
            graphs: None,
        })
    }

    /// Records a step's GPU work as CUDA graphs and replays it for the
    /// steps after (see [`bastile::graph`]): after
    /// two plain steps with the same micro-batch shapes, the third is
    /// recorded, and each later step with those shapes is its replay, its
    /// micro-batches copied into the recorded inputs and its learning rate
    /// into the recorded update. The host then queues a step in a few
    /// graph launches instead of every kernel, which is what bounds a
    /// short step. Steps of other shapes run plainly.
    ///
    /// Needs the fused AdamW, one worker, and `Autodiff<Bastile<CudaDirect>>`
    /// with CUPTI on the library path; a step that cannot be recorded (an
    /// allocation or a host wait inside it, LoRA dropout, whose masks a
    /// replay would repeat) is reported once on stderr and in
    /// [`Trainer::step_graph_refusal`], and training goes on with plain
    /// steps. All of the trainer's steps run on
    /// a CubeCL stream of their own ([`bastile::graph::GraphStream`]), so
    /// tensors the program makes between steps never share memory with a
    /// recorded step's intermediate values. The model's parameters and the
    /// optimizer's state are updated in place; a model whose parameters
    /// another owner holds (a clone kept aside) is copied by the update
    /// instead, which the recording detects (training goes on plainly).
    pub fn with_step_graphs(mut self) -> Result<Self, ModelError> {
        if self.config.optimizer != OptimizerKind::Fused {
            return Err(ModelError::Config(
                "step graphs need the fused AdamW (its update reads the step's factors from \
                 the device)"
                    .into(),
            ));
        }
        if self.world.is_some() || self.peers.is_some() {
            return Err(ModelError::Config(
                "step graphs train on one device, not data-parallel".into(),
            ));
        }
        self.graphs = Some(StepGraphs {
            stream: bastile::graph::GraphStream::new(),
            shapes: Vec::new(),
            same_shape_steps: 0,
            recorded: None,
            refused: None,
        });
        Ok(self)
    }

    /// Whether [`Trainer::with_step_graphs`] was asked for (a trainer with
    /// step graphs trains on one device).
    pub(crate) fn has_step_graphs(&self) -> bool {
        self.graphs.is_some()
    }

    /// The stream every step runs on with [`Trainer::with_step_graphs`]
    /// (its memory pool holds the steps' memory).
    pub fn graph_stream(&self) -> Option<bastile::graph::GraphStream> {
        self.graphs.as_ref().map(|g| g.stream)
    }

    /// Why the steps are not recorded (see [`Trainer::with_step_graphs`]),
    /// once a recording was refused.
    pub fn step_graph_refusal(&self) -> Option<&str> {
        self.graphs.as_ref()?.refused.as_deref()
    }

    /// Whether the steps replay a recorded step now (see
    /// [`Trainer::with_step_graphs`]), and the kernels one replay launches.
    pub fn replaying(&self) -> Option<usize> {
        let recorded = self.graphs.as_ref()?.recorded.as_ref()?;
        Some(recorded.graph.kernels())
    }

    /// Optimizer steps taken.
    pub fn steps(&self) -> usize {
        self.step
    }

    /// The mean loss over every counted token of `batches` (HF's shifted
    /// cross-entropy, as [`Trainer::step`] computes it), without gradients
    /// or any change: for an evaluation set. Each batch's ids and labels
    /// are checked (read back) before its loss; the sums are read once, at
    /// the end. An error when no label counts.
    pub fn evaluate(model: &CausalLm<B>, batches: &[MicroBatch<B>]) -> Result<f64, ModelError>
    where
        CausalLm<B>: AutodiffModule<B, InnerModule = CausalLm<B::InnerBackend>>,
    {
        let model = model.valid();
        let options = CrossEntropyOptions::default().with_reduction(Reduction::Sum);
        let mut sums = Vec::with_capacity(batches.len());
        let mut counts = Vec::with_capacity(batches.len());
        for m in batches {
            let out = model.loss_of(
                m.ids.clone().inner(),
                m.labels.clone().inner(),
                m.positions.clone().map(|p| p.inner()),
                options,
            )?;
            sums.push(out.loss);
            counts.push(out.tokens);
        }
        if sums.is_empty() {
            return Err(ModelError::Config(
                "an evaluation needs at least one batch".into(),
            ));
        }
        let loss: Vec<f64> = read_back(Tensor::cat(sums, 0).sum(), None)?;
        let tokens: Vec<i64> = read_back(Tensor::cat(counts, 0).sum(), None)?;
        if tokens[0] == 0 {
            return Err(ModelError::Config(
                "no label of the evaluation batches counts".into(),
            ));
        }
        Ok(loss[0] / tokens[0] as f64)
    }

    /// Writes what resuming needs besides the model into `dir`: the
    /// optimizer's state (moments, master weights, step count; the Burn
    /// record `optimizer.mpk`, full precision) and `trainer.json` (the
    /// steps taken and the config, whose schedule they index).
    pub fn save_state(&self, dir: &Path) -> Result<(), ModelError>
    where
        CausalLm<B>: AutodiffModule<B>,
    {
        let path = dir.join(OPTIMIZER_RECORD);
        let recorder = NamedMpkFileRecorder::<FullPrecisionSettings>::new();
        let written = match &self.optimizer {
            TrainOptimizer::Fused(adamw) => {
                let record = <FusedAdamW<B> as Optimizer<CausalLm<B>, B>>::to_record(adamw);
                recorder.record(record, path.clone())
            }
            TrainOptimizer::Burn(adamw) => recorder.record(adamw.to_record(), path.clone()),
        };
        written.map_err(|e| record_error(&path, e))?;
        let state = TrainerState {
            step: self.step,
            config: self.config.clone(),
        };
        let json = serde_json::to_string_pretty(&state).expect("the state serializes");
        let state_path = dir.join(TRAINER_STATE);
        std::fs::write(&state_path, json).map_err(|e| ModelError::io(&state_path, e))
    }

    /// Takes back what [`Self::save_state`] wrote into `dir`: the optimizer
    /// state and the steps taken, so the next step is the one after them
    /// on the same schedule. The config must be the one the state was
    /// saved with (an error names both otherwise), and the model must be
    /// the checkpoint's, loaded from its record (the state is keyed by its
    /// parameters' ids). A data-parallel trainer's workers each load it.
    pub fn load_state(mut self, dir: &Path, device: &B::Device) -> Result<Self, ModelError>
    where
        CausalLm<B>: AutodiffModule<B>,
    {
        if let Some(peers) = &mut self.peers {
            peers.load_state(dir)?;
        }
        let state_path = dir.join(TRAINER_STATE);
        let state: TrainerState = crate::error::read_json(&state_path)?;
        if state.config != self.config {
            return Err(ModelError::Config(format!(
                "{} was saved with {:?}; this run has {:?}",
                state_path.display(),
                state.config,
                self.config
            )));
        }
        if state.step > self.config.total_steps {
            return Err(ModelError::Config(format!(
                "{}: {} steps taken, more than the schedule's {}",
                state_path.display(),
                state.step,
                self.config.total_steps
            )));
        }
        let path = dir.join(OPTIMIZER_RECORD);
        let recorder = NamedMpkFileRecorder::<FullPrecisionSettings>::new();
        self.optimizer = match self.optimizer {
            TrainOptimizer::Fused(adamw) => {
                let record = recorder
                    .load(path.clone(), device)
                    .map_err(|e| record_error(&path, e))?;
                let adamw =
                    <FusedAdamW<B> as Optimizer<CausalLm<B>, B>>::load_record(adamw, record);
                TrainOptimizer::Fused(adamw)
            }
            TrainOptimizer::Burn(adamw) => {
                let record = recorder
                    .load(path.clone(), device)
                    .map_err(|e| record_error(&path, e))?;
                TrainOptimizer::Burn(adamw.load_record(record))
            }
        };
        self.step = state.step;
        if let Some(graphs) = &mut self.graphs {
            // A recorded step updates the optimizer state it was recorded
            // with, which the loaded one replaces.
            graphs.record_again();
        }
        Ok(self)
    }

    /// One optimizer step over `micro_batches` (gradient accumulation):
    /// each micro-batch's loss is normalized by the token count of all of
    /// them, so the step follows the mean over every counted token, as one
    /// large batch would.
    ///
    /// The whole step is queued before anything is read back: the token
    /// count and the checks of the input ids and labels run on the device,
    /// and the loss, the gradient norm, the count and the checks are read
    /// once, at the end. An input id or label out of range, a step in
    /// which no label counts, a loss or gradient that is not finite, or a
    /// kernel launch that fails (see [`bastile::launch_failure`]; an error
    /// the device reports while the results are read), is an error naming
    /// the step, and that step changes no parameter: the fused AdamW skips
    /// it on the device, and writes nothing after a failed launch. Burn's
    /// AdamW, which cannot skip on the device, has the checks and the loss
    /// read before it runs (one wait inside the step). Rows shorter than
    /// two positions are an error before anything runs. The model comes
    /// back either way.
    ///
    /// Data-parallel ([`Trainer::data_parallel`]), `micro_batches` are
    /// every worker's, shared out in order, and the step returns once all
    /// workers are done; see [`crate::parallel`] for what a failing worker
    /// does.
    pub fn step(&mut self, model: CausalLm<B>, micro_batches: &[MicroBatch<B>]) -> Stepped<B>
    where
        CausalLm<B>: AutodiffModule<B>,
    {
        let Some(peers) = &mut self.peers else {
            let (model, out, _) = self.step_here(model, micro_batches);
            return (model, out);
        };
        if let Some(e) = peers.failure() {
            return (model, Err(e));
        }
        let mut shares = match shares(micro_batches.to_vec(), peers.workers()) {
            Ok(shares) => shares,
            Err(e) => return (model, Err(e)),
        };
        let own = shares.remove(0);
        if let Err(e) = peers.send_shares(shares) {
            return (model, Err(e));
        }
        let step = self.step + 1;
        let (model, out, cause) = self.step_here(model, &own);
        let peers = self.peers.as_mut().expect("data-parallel");
        if peers.stepping() {
            // Worker 0 failed before it read its results, which it does
            // after the others answer (see `read_after_peers`): it may not
            // have queued its part of the collective operations, which the
            // others then wait on forever.
            let e = match out {
                Err(e) => e,
                Ok(_) => ModelError::Config("the step ended before the workers answered".into()),
            };
            peers.fail_here(&e);
            return (model, Err(e));
        }
        let outcomes = match peers.take_outcomes(step) {
            Ok(outcomes) => outcomes,
            Err(e) => return (model, Err(e)),
        };
        // Workers that disagree on whether the step applied (one failed
        // before its collective operations), or sums that gave up on a
        // worker, leave replicas that differ: the run cannot go on.
        let applied = out.is_ok();
        let split = outcomes.iter().any(|(o, _)| o.is_ok() != applied);
        let mut out = combine((out, cause), outcomes);
        let broken = self.world.as_ref().and_then(World::broken);
        if let (Some(why), Ok(_)) = (&broken, &out) {
            out = Err(ModelError::Worker {
                worker: 0,
                message: why.clone(),
            });
        }
        if let (true, Err(e)) = (split || broken.is_some(), &out) {
            peers.fail_here(e);
        }
        (model, out)
    }

    /// [`Trainer::step`] on this worker's own micro-batches; the error's
    /// [`Cause`] tells a data-parallel step where it came from.
    pub(crate) fn step_here(
        &mut self,
        model: CausalLm<B>,
        micro_batches: &[MicroBatch<B>],
    ) -> (CausalLm<B>, Result<StepOutput, ModelError>, Cause)
    where
        CausalLm<B>: AutodiffModule<B>,
    {
        if micro_batches.is_empty() {
            let e = ModelError::Config("a step needs at least one micro-batch".into());
            if let Some(world) = &self.world {
                world.abandon(&e);
            }
            return (model, Err(e), Cause::Early);
        }
        if let Some(stream) = self.graphs.as_ref().map(|g| g.stream) {
            let (model, out) = stream.run(|| self.step_with_graphs(model, micro_batches));
            return (model, out, Cause::Here);
        }
        self.step_plainly(model, micro_batches)
    }

    /// [`Trainer::step_here`] without step graphs.
    fn step_plainly(
        &mut self,
        model: CausalLm<B>,
        micro_batches: &[MicroBatch<B>],
    ) -> (CausalLm<B>, Result<StepOutput, ModelError>, Cause)
    where
        CausalLm<B>: AutodiffModule<B>,
    {
        let step = self.step + 1;
        let started = Instant::now();
        let (applied, failures) =
            bastile::capture_launch_failures(|| self.apply(step, started, model, micro_batches));
        let Applied {
            model,
            verdict,
            mut cause,
            host,
            counted,
        } = applied;
        // A failed launch leaves every later result meaningless (a loss or
        // norm read from it may look fine, or not finite): it is the error.
        let verdict = match failures.first() {
            Some(failure) => {
                if cause == Cause::Elsewhere {
                    cause = Cause::Here;
                }
                Err(ModelError::Step {
                    step,
                    message: format!("{failure}; the step was skipped and no parameter changed"),
                })
            }
            None => verdict,
        };
        if let (Err(e), Cause::Early, Some(world)) = (&verdict, cause, &self.world) {
            // The other workers would wait for this one's gradients.
            world.abandon(e);
        }
        let out = self.conclude(step, verdict, counted, host);
        (model, out, cause)
    }

    /// Step number `step`'s output from its verdict: the step counts when
    /// it applied; a step the fused AdamW counted but skipped is taken
    /// back from its count.
    fn conclude(
        &mut self,
        step: usize,
        verdict: Result<(f64, usize), ModelError>,
        counted: bool,
        host: Duration,
    ) -> Result<StepOutput, ModelError> {
        if verdict.is_err()
            && counted
            && let TrainOptimizer::Fused(adamw) = &mut self.optimizer
        {
            adamw.forget_skipped_step();
        }
        verdict.map(|(loss, tokens)| {
            self.step += 1;
            StepOutput {
                loss,
                tokens,
                learning_rate: self.config.lr_at(step - 1),
                host_seconds: host.as_secs_f64(),
            }
        })
    }

    /// A step with [`Trainer::with_step_graphs`], on the graphs' stream: a
    /// replay of the recorded step when the micro-batches have its shapes,
    /// the recording itself after enough plain steps of one shape, a plain
    /// step otherwise.
    fn step_with_graphs(
        &mut self,
        model: CausalLm<B>,
        micro_batches: &[MicroBatch<B>],
    ) -> Stepped<B>
    where
        CausalLm<B>: AutodiffModule<B>,
    {
        let shapes = batch_shapes(micro_batches);
        let graphs = self.graphs.as_mut().expect("step graphs");
        if let Some(recorded) = &graphs.recorded
            && batch_shapes(&recorded.inputs) == shapes
        {
            // The recorded step updates the buffers it was recorded with:
            // another model, or parameters replaced since, are stepped
            // plainly and recorded again.
            match parameter_addresses(&model) {
                Ok(now) if now == recorded.parameters => {
                    return self.replay(model, micro_batches);
                }
                Ok(_) => {
                    eprintln!(
                        "bastile: the model's parameters are not the ones the recorded step \
                         updates; the step runs plainly and is recorded again"
                    );
                    graphs.record_again();
                }
                Err(e) => graphs.refuse(e.to_string()),
            }
        }
        let graphs = self.graphs.as_ref().expect("step graphs");
        if graphs.recorded.is_none()
            && graphs.refused.is_none()
            && graphs.shapes == shapes
            && graphs.same_shape_steps >= PLAIN_STEPS_BEFORE_RECORDING
        {
            return self.record(model, micro_batches);
        }
        let (model, out, _) = self.step_plainly(model, micro_batches);
        let graphs = self.graphs.as_mut().expect("step graphs");
        if out.is_ok() {
            if graphs.shapes == shapes {
                graphs.same_shape_steps += 1;
            } else {
                graphs.shapes = shapes;
                graphs.same_shape_steps = 1;
            }
        }
        (model, out)
    }

    /// Records the step's GPU work while queueing it, then runs it; a step
    /// that cannot be recorded runs plainly, and so do the later ones.
    fn record(&mut self, model: CausalLm<B>, micro_batches: &[MicroBatch<B>]) -> Stepped<B>
    where
        CausalLm<B>: AutodiffModule<B>,
    {
        if let Some(lora) = model.lora.as_ref().filter(|l| l.dropout > 0.0) {
            let why = format!(
                "LoRA dropout ({}) draws new masks every step, which a replay would repeat",
                lora.dropout
            );
            return self.refuse_recording(why, model, micro_batches);
        }
        let step = self.step + 1;
        let started = Instant::now();
        let device = micro_batches[0].ids.device();
        let lr = self.config.lr_at(step - 1);
        // Made outside the recording, which reads them at every replay:
        // the inputs (copies of this step's) and the update's factors.
        let inputs = match micro_batches
            .iter()
            .map(recorded_input)
            .collect::<Result<Vec<_>, _>>()
        {
            Ok(inputs) => inputs,
            Err(e) => return self.refuse_recording(e, model, micro_batches),
        };
        let adamw = graphs_adamw(&mut self.optimizer);
        adamw.upload_next_factors(lr, &device);
        let before = match parameter_addresses(&model) {
            Ok(addresses) => addresses,
            Err(e) => return self.refuse_recording(e, model, micro_batches),
        };
        if let Err(e) = bastile::graph::begin_capture::<B>(&device) {
            return self.refuse_recording(e, model, micro_batches);
        }
        let ((model, queued), failures) = bastile::capture_launch_failures(|| {
            let queued = match self.queue(&model, &inputs) {
                Ok(queued) => queued,
                Err(e) => return (model, Err(e)),
            };
            let adamw = graphs_adamw(&mut self.optimizer);
            let (model, norm) = update_fused(adamw, lr, model, queued.grads, &queued.results);
            (model, Ok((queued.results, norm)))
        });
        let ended = bastile::graph::end_capture::<B>(&device);
        let adamw = graphs_adamw(&mut self.optimizer);
        // Nothing ran while recording: on any failure the update the
        // optimizer counted is taken back and the step runs plainly, where
        // a failure of its own is reported as such.
        let (results, norm) = match queued {
            Ok(step) => step,
            Err(e) => {
                // The micro-batches were refused before anything was
                // queued, and before the optimizer counted the step.
                drop(ended);
                return (model, Err(e));
            }
        };
        let graph = match (ended, failures.first()) {
            (Ok(graph), None) => graph,
            (Ok(_), Some(failure)) => {
                adamw.forget_skipped_step();
                return self.refuse_recording(failure, model, micro_batches);
            }
            (Err(e), _) => {
                adamw.forget_skipped_step();
                return self.refuse_recording(e, model, micro_batches);
            }
        };
        let factors = adamw.last_factors().expect("the recorded update's factors");
        if let Err(e) = graph.launch() {
            let message = format!("the recorded step failed to launch: {e}");
            let out = self.conclude(
                step,
                Err(ModelError::Step { step, message }),
                true,
                started.elapsed(),
            );
            return (model, out);
        }
        let host = started.elapsed();
        let (verdict, _) = results.clone().read(step, norm.clone());
        let out = self.conclude(step, verdict, true, host);
        let graphs = self.graphs.as_mut().expect("step graphs");
        match parameter_addresses(&model) {
            Ok(after) if after == before => {
                graphs.recorded = Some(Recorded {
                    graph,
                    inputs,
                    results,
                    norm,
                    factors,
                    parameters: after,
                });
            }
            Ok(_) => {
                let why = "the update did not write every parameter in place (another owner \
                           holds one, such as a clone of the model kept aside)";
                graphs.refuse(why.into());
            }
            Err(e) => graphs.refuse(e.to_string()),
        }
        (model, out)
    }

    /// Notes why the step could not be recorded and runs it plainly.
    fn refuse_recording(
        &mut self,
        why: impl std::fmt::Display,
        model: CausalLm<B>,
        micro_batches: &[MicroBatch<B>],
    ) -> Stepped<B>
    where
        CausalLm<B>: AutodiffModule<B>,
    {
        self.graphs
            .as_mut()
            .expect("step graphs")
            .refuse(why.to_string());
        let (model, out, _) = self.step_plainly(model, micro_batches);
        (model, out)
    }

    /// Replays the recorded step on `micro_batches`: they are copied into
    /// the recorded inputs and this step's factors into the recorded
    /// update's, then the graphs are launched and the results read.
    fn replay(&mut self, model: CausalLm<B>, micro_batches: &[MicroBatch<B>]) -> Stepped<B>
    where
        CausalLm<B>: AutodiffModule<B>,
    {
        let step = self.step + 1;
        let started = Instant::now();
        let lr = self.config.lr_at(step - 1);
        let adamw = graphs_adamw(&mut self.optimizer);
        let recorded = self
            .graphs
            .as_ref()
            .and_then(|g| g.recorded.as_ref())
            .expect("a recorded step");
        let factors = adamw.count_replayed_step(lr);
        let device = micro_batches[0].ids.device();
        let queued = copy_inputs(&recorded.inputs, micro_batches)
            .and_then(|()| {
                let values = Tensor::<B::InnerBackend, 1>::from_data(
                    burn::tensor::TensorData::new(factors.to_vec(), [3]),
                    &device,
                );
                bastile::graph::copy_into(&recorded.factors, values)
            })
            .and_then(|()| recorded.graph.launch());
        let (verdict, host) = match queued {
            Ok(()) => {
                let host = started.elapsed();
                let (verdict, _) = recorded.results.clone().read(step, recorded.norm.clone());
                (verdict, host)
            }
            Err(e) => {
                let message = format!("the recorded step could not be replayed: {e}");
                (Err(ModelError::Step { step, message }), started.elapsed())
            }
        };
        let out = self.conclude(step, verdict, true, host);
        (model, out)
    }

    /// Queues step number `step`, applies the optimizer unless the step must
    /// change nothing, and reads the results.
    fn apply(
        &mut self,
        step: usize,
        started: Instant,
        model: CausalLm<B>,
        micro_batches: &[MicroBatch<B>],
    ) -> Applied<B>
    where
        CausalLm<B>: AutodiffModule<B>,
    {
        let queued = match self.queue(&model, micro_batches) {
            Ok(queued) => queued,
            Err(e) => {
                return Applied {
                    model,
                    verdict: Err(e),
                    cause: Cause::Early,
                    host: started.elapsed(),
                    counted: false,
                };
            }
        };
        let lr = self.config.lr_at(step - 1);
        match &mut self.optimizer {
            TrainOptimizer::Fused(adamw) => {
                let (model, norm) = update_fused(adamw, lr, model, queued.grads, &queued.results);
                if let Some(world) = &self.world {
                    // Worker 0 reads its results only once the others
                    // answered, after their own update ran: until a read,
                    // Burn's fusion may hold the update's operations back.
                    world.flush(&queued.results.loss.device());
                }
                let host = started.elapsed();
                let (verdict, cause) =
                    read_after_peers(&mut self.peers, queued.results, step, norm);
                Applied {
                    model,
                    verdict,
                    cause,
                    host,
                    counted: true,
                }
            }
            TrainOptimizer::Burn(adamw) => {
                let passes = started.elapsed();
                let (verdict, cause) =
                    read_after_peers(&mut self.peers, queued.results, step, None);
                let optimizer = Instant::now();
                let model = if verdict.is_ok() && !bastile::launch_failed() {
                    let grads = match self.config.max_grad_norm {
                        Some(max) => clip_grad_norm(&model, queued.grads, max),
                        None => queued.grads,
                    };
                    adamw.step(lr, model, grads)
                } else {
                    model
                };
                Applied {
                    model,
                    verdict,
                    cause,
                    host: passes + optimizer.elapsed(),
                    counted: false,
                }
            }
        }
    }

    /// Queues every micro-batch's forward and backward pass; nothing is
    /// read back.
    fn queue(
        &self,
        model: &CausalLm<B>,
        micro_batches: &[MicroBatch<B>],
    ) -> Result<QueuedStep<B>, ModelError> {
        let ignore = CrossEntropyOptions::default().ignore_index;
        // Counted tokens of all micro-batches (labels after the shift;
        // position 0 never counts): every loss is divided by their sum.
        let mut total: Option<Tensor<B, 1, Int>> = None;
        for m in micro_batches {
            let [_, s] = m.labels.dims();
            if s >= 2 {
                let labels = match &m.positions {
                    Some(p) => packed_labels(m.labels.clone(), p.clone(), ignore),
                    None => m.labels.clone(),
                };
                let counted = labels.narrow(1, 1, s - 1).not_equal_elem(ignore);
                let count = counted.int().sum();
                total = Some(match total {
                    Some(t) => t + count,
                    None => count,
                });
            }
        }
        let device = micro_batches[0].labels.device();
        let total = total.unwrap_or_else(|| Tensor::zeros([1], &device));
        // Every worker's loss is divided by the tokens of all of them:
        // their sum waits for the other workers while the forward pass is
        // queued, and is read once the first loss is divided by it.
        let summing = self
            .world
            .as_ref()
            .map(|world| (world, world.sum_unsettled(total.clone().float())));
        let mut divided_by: Option<Tensor<B, 1>> = None;
        let mut divisor = || {
            let divisor = divided_by.get_or_insert_with(|| match &summing {
                Some((world, sum)) => {
                    world.settle(&device);
                    sum.clone().clamp_min(1.0)
                }
                None => total.clone().float().clamp_min(1.0),
            });
            divisor.clone()
        };
        let options = CrossEntropyOptions::default()
            .with_reduction(Reduction::Sum)
            .with_weight_grad_sum(self.config.loss_weight_grad_sum)
            .with_deferred_label_check();
        let mut accumulator = GradientsAccumulator::new();
        let mut losses = Vec::with_capacity(micro_batches.len());
        let mut checks = Vec::with_capacity(micro_batches.len());
        let mut id_checks = Vec::with_capacity(micro_batches.len());
        for m in micro_batches {
            id_checks.push(model.check_token_ids(&m.ids));
            let (ids, labels, positions) = (m.ids.clone(), m.labels.clone(), m.positions.clone());
            let (out, grads) = match &self.world {
                // Each segment's gradients are summed over the workers as
                // soon as its backward pass is queued, while the rest of
                // the backward pass runs.
                Some(world) if world.sums_during_backward() => {
                    let mut sums = world.gradient_sums();
                    let (out, mut grads) = model.loss_and_grads_into(
                        ids,
                        labels,
                        positions,
                        options,
                        &mut divisor,
                        Some(&mut sums),
                    )?;
                    sums.finish(&mut grads, &device)?;
                    (out, grads)
                }
                _ => model.loss_and_grads(ids, labels, positions, options, divisor())?,
            };
            losses.push(out.loss);
            checks.push(out.label_check.expect("a deferred label check"));
            accumulator.accumulate(model, grads);
        }
        let settled = divided_by.is_some();
        let total = match summing {
            Some((world, sum)) => {
                if !settled {
                    world.settle(&device);
                }
                sum.int()
            }
            None => total,
        };
        let mut grads = accumulator.grads();
        if let Some(world) = self.world.as_ref().filter(|w| !w.sums_during_backward()) {
            grads = world.sum_grads(model, grads, &device);
        }
        let mut loss = Tensor::cat(losses, 0).sum();
        let own_skip = skip_flag(&loss, &total, &checks, &id_checks);
        let skip = match &self.world {
            Some(world) => {
                loss = world.sum(loss);
                world.any(own_skip.clone().bool_or(skip_flag(&loss, &total, &[], &[])))
            }
            None => own_skip.clone(),
        };
        Ok(QueuedStep {
            grads,
            results: StepResults {
                loss,
                tokens: total,
                checks,
                id_checks,
                seq: micro_batches.iter().map(|m| m.labels.dims()[1]).collect(),
                skip,
                own_skip: self.world.as_ref().map(|_| own_skip),
            },
        })
    }
}

/// The fused AdamW's update of a queued step, skipped on the device when
/// the step's flags say so: the model and the step's gradient norm.
fn update_fused<B>(
    adamw: &mut FusedAdamW<B>,
    lr: f64,
    model: CausalLm<B>,
    grads: GradientsParams,
    results: &StepResults<B>,
) -> (CausalLm<B>, Option<Tensor<B, 1>>)
where
    B: AutodiffBackend + BastileBackend,
    B::InnerBackend: BastileBackend,
    CausalLm<B>: AutodiffModule<B>,
{
    let skip = results.skip.clone().inner();
    let model = adamw.step_unless(lr, model, grads, skip);
    let norm = adamw.last_norm().map(Tensor::from_inner);
    (model, norm)
}

/// The fused AdamW, which [`Trainer::with_step_graphs`] requires.
fn graphs_adamw<B>(optimizer: &mut TrainOptimizer<B>) -> &mut FusedAdamW<B>
where
    B: AutodiffBackend + BastileBackend,
{
    match optimizer {
        TrainOptimizer::Fused(adamw) => adamw,
        TrainOptimizer::Burn(_) => unreachable!("step graphs need the fused AdamW"),
    }
}

impl<B: AutodiffBackend> StepGraphs<B> {
    /// Drops the recording: the next steps of one shape are stepped
    /// plainly and recorded anew.
    fn record_again(&mut self) {
        self.recorded = None;
        self.same_shape_steps = 0;
    }

    /// Gives up recording (reported once): later steps run plainly.
    fn refuse(&mut self, why: String) {
        eprintln!("bastile: the training step is not recorded as a CUDA graph: {why}");
        self.refused = Some(why);
    }
}

/// What a recorded step's micro-batches must match: each one's shape and
/// whether it packs documents.
fn batch_shapes<B: AutodiffBackend>(micro_batches: &[MicroBatch<B>]) -> Vec<([usize; 2], bool)> {
    micro_batches
        .iter()
        .map(|m| (m.ids.dims(), m.positions.is_some()))
        .collect()
}

/// A copy of `m` in buffers of its own, for a recording to read.
fn recorded_input<B>(m: &MicroBatch<B>) -> Result<MicroBatch<B>, bastile::BastileError>
where
    B: AutodiffBackend + BastileBackend,
{
    let own = |t: &Tensor<B, 2, Int>| {
        let copy = Tensor::empty(t.dims(), &t.device());
        bastile::graph::copy_ints_into(&copy, t.clone()).map(|()| copy)
    };
    Ok(MicroBatch {
        ids: own(&m.ids)?,
        labels: own(&m.labels)?,
        positions: m.positions.as_ref().map(own).transpose()?,
    })
}

/// Copies each micro-batch into the recorded input of its place.
fn copy_inputs<B>(
    recorded: &[MicroBatch<B>],
    micro_batches: &[MicroBatch<B>],
) -> Result<(), bastile::BastileError>
where
    B: AutodiffBackend + BastileBackend,
{
    for (into, m) in recorded.iter().zip(micro_batches) {
        bastile::graph::copy_ints_into(&into.ids, m.ids.clone())?;
        bastile::graph::copy_ints_into(&into.labels, m.labels.clone())?;
        if let (Some(into), Some(p)) = (&into.positions, &m.positions) {
            bastile::graph::copy_ints_into(into, p.clone())?;
        }
    }
    Ok(())
}

/// The device addresses of the model's parameters.
fn parameter_addresses<B>(model: &CausalLm<B>) -> Result<Vec<u64>, bastile::BastileError>
where
    B: AutodiffBackend,
    B::InnerBackend: BastileBackend,
    CausalLm<B>: AutodiffModule<B>,
{
    struct Params<B: AutodiffBackend>(Vec<FloatTensor<B::InnerBackend>>);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Params<B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.push(param.val().inner().into_primitive().tensor());
        }
    }
    let mut params = Params::<B>(Vec::new());
    model.visit(&mut params);
    bastile::graph::buffer_addresses::<B::InnerBackend>(params.0)
}

/// The optimizer record [`Trainer::save_state`] writes (Burn adds `.mpk`).
const OPTIMIZER_RECORD: &str = "optimizer";
/// The steps taken and the config, beside the optimizer record.
const TRAINER_STATE: &str = "trainer.json";

/// The contents of `trainer.json`.
#[derive(Serialize, Deserialize)]
struct TrainerState {
    step: usize,
    config: TrainConfig,
}

/// A record that could not be written or read, as an I/O error of its file.
fn record_error(path: &Path, e: RecorderError) -> ModelError {
    ModelError::io(
        path.with_extension("mpk"),
        std::io::Error::other(e.to_string()),
    )
}

/// What a step gives back: the model, and the step's output or error.
type Stepped<B> = (CausalLm<B>, Result<StepOutput, ModelError>);

/// A step as [`Trainer::step`]'s captured part leaves it.
struct Applied<B: AutodiffBackend> {
    model: CausalLm<B>,
    /// `(loss, tokens)`, or the step's error.
    verdict: Result<(f64, usize), ModelError>,
    /// Where the error came from.
    cause: Cause,
    /// The host time spent queueing the step.
    host: Duration,
    /// Whether the fused AdamW counted the step (it does before it knows
    /// whether the step is skipped).
    counted: bool,
}

/// A step whose passes are queued, and what it will read back.
struct QueuedStep<B: AutodiffBackend> {
    grads: GradientsParams,
    results: StepResults<B>,
}

/// The device values a step reports, read together at its end.
#[derive(Clone)]
struct StepResults<B: AutodiffBackend> {
    /// The mean loss over every counted token, `[1]`.
    loss: Tensor<B, 1>,
    tokens: Tensor<B, 1, Int>,
    checks: Vec<LabelCheck<B>>,
    id_checks: Vec<IdCheck<B>>,
    /// Each micro-batch's sequence length, to name an offending label's
    /// row and column.
    seq: Vec<usize>,
    /// `[1]`: the step must change nothing (on every worker, when
    /// data-parallel).
    skip: Tensor<B, 1, Bool>,
    /// Data-parallel: `[1]`, this worker's own checks failed (when
    /// `skip` is set but not this, another worker's did).
    own_skip: Option<Tensor<B, 1, Bool>>,
}

/// A tensor's values, read back (this waits for the device); an error the
/// device reports comes back as the error of training step `step`, or as
/// [`ModelError::Device`] outside a step.
fn read_back<B: Backend, K: BasicOps<B>, E: Element>(
    t: Tensor<B, 1, K>,
    step: Option<usize>,
) -> Result<Vec<E>, ModelError> {
    let error = |message: String| match step {
        Some(step) => ModelError::Step { step, message },
        None => ModelError::Device(message),
    };
    t.try_into_data()
        .map_err(|e| error(format!("the device failed: {e}")))?
        .convert::<E>()
        .into_vec::<E>()
        .map_err(|e| error(format!("results could not be read: {e:?}")))
}

/// `[1]` on the device: the step must change nothing (an input id or
/// label out of range, no label that counts, a loss that is not finite).
fn skip_flag<B: AutodiffBackend>(
    loss: &Tensor<B, 1>,
    tokens: &Tensor<B, 1, Int>,
    checks: &[LabelCheck<B>],
    id_checks: &[IdCheck<B>],
) -> Tensor<B, 1, Bool> {
    let mut skip = loss.clone().is_nan().bool_or(loss.clone().is_inf());
    skip = skip.bool_or(tokens.clone().equal_elem(0));
    for check in checks {
        skip = skip.bool_or(check.failed());
    }
    for check in id_checks {
        skip = skip.bool_or(check.failed());
    }
    skip
}

/// Worker 0 of a data-parallel step waits for the other workers before it
/// reads its own results: a worker that failed before queuing its share of
/// the collective operations would leave worker 0's device, and that read,
/// waiting forever. The others read theirs at once.
fn read_after_peers<B: AutodiffBackend>(
    peers: &mut Option<Peers<B>>,
    results: StepResults<B>,
    step: usize,
    norm: Option<Tensor<B, 1>>,
) -> (Result<(f64, usize), ModelError>, Cause) {
    if let Some(peers) = peers
        && let Err(e) = peers.collect(step)
    {
        return (Err(e), Cause::Here);
    }
    results.read(step, norm)
}

impl<B: AutodiffBackend> StepResults<B> {
    /// Reads the step's values (two transfers, after everything is queued)
    /// and returns `(loss, tokens)`, or the error of step number `step` and
    /// where it came from.
    fn read(
        self,
        step: usize,
        norm: Option<Tensor<B, 1>>,
    ) -> (Result<(f64, usize), ModelError>, Cause) {
        // Set: the step is skipped for another worker's batch.
        let elsewhere = self
            .own_skip
            .as_ref()
            .map(|own| self.skip.clone().bool_and(own.clone().bool_not()));
        match self.read_values(step, norm, elsewhere) {
            Ok(Some(values)) => (Ok(values), Cause::Here),
            Ok(None) => (
                Err(ModelError::Step {
                    step,
                    message: "another worker's batch failed its checks; the step was skipped \
                              on every worker and no parameter changed"
                        .into(),
                }),
                Cause::Elsewhere,
            ),
            Err(e) => (Err(e), Cause::Here),
        }
    }

    /// [`Self::read`]'s values: `None` when `elsewhere` (`[1]`) is set and
    /// this worker's own values are fine.
    fn read_values(
        self,
        step: usize,
        norm: Option<Tensor<B, 1>>,
        elsewhere: Option<Tensor<B, 1, Bool>>,
    ) -> Result<Option<(f64, usize)>, ModelError> {
        let norm_at = 1 + usize::from(elsewhere.is_some());
        let mut floats = vec![self.loss];
        floats.extend(elsewhere.map(|e| e.float()));
        floats.extend(norm);
        // Both gatherings are queued before the first read, which then
        // runs them both: the second read finds its values ready instead
        // of queuing its own work behind a round trip.
        let floats = Tensor::cat(floats, 0);
        let mut ints = vec![self.tokens];
        ints.extend(self.id_checks.iter().map(IdCheck::found));
        ints.extend(self.checks.iter().map(LabelCheck::found));
        let ints: Vec<i64> = read_back(Tensor::cat(ints, 0), Some(step))?;
        let step_error = |message: String| Err(ModelError::Step { step, message });
        for (i, check) in self.id_checks.iter().enumerate() {
            if let Some(e) = check.error([ints[1 + 2 * i], ints[2 + 2 * i]]) {
                return step_error(format!("micro-batch {i}: {e}"));
            }
        }
        let labels_at = 1 + 2 * self.id_checks.len();
        for (i, (check, seq)) in self.checks.iter().zip(&self.seq).enumerate() {
            let found = [ints[labels_at + 2 * i], ints[labels_at + 1 + 2 * i]];
            if let Some(e) = check.error(found) {
                // The loss saw the labels shifted by one: flat position p
                // is row p / seq, column p % seq + 1 of the batch's labels.
                let p = found[0] as usize;
                return step_error(format!(
                    "micro-batch {i}, row {}, column {}: {e}",
                    p / seq,
                    p % seq + 1
                ));
            }
        }
        if ints[0] == 0 {
            return step_error(
                "no label counts in any micro-batch (each is the ignore index, or in the first \
                 column, which nothing predicts); the step was skipped and no parameter changed"
                    .into(),
            );
        }
        let floats: Vec<f64> = read_back(floats, Some(step))?;
        let loss = floats[0];
        let norm = floats.get(norm_at).copied();
        // Skipped for another worker's batch: the fused AdamW made the norm
        // NaN to skip, and the loss (summed over the workers) is finite.
        if loss.is_finite() && norm_at == 2 && floats[1] != 0.0 {
            return Ok(None);
        }
        if !loss.is_finite() || norm.is_some_and(|n| !n.is_finite()) {
            let norm = norm.map_or(String::new(), |n| format!(", gradient norm {n}"));
            return Err(ModelError::NonFinite {
                step,
                message: format!(
                    "loss {loss}{norm} is not finite; the step was skipped and no parameter changed"
                ),
            });
        }
        Ok(Some((loss, ints[0] as usize)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A configuration saved before the loss's weight-gradient option
    /// existed reads as `Exact` (what it trained with), not as today's
    /// default; the option is saved by its lowercase name and read back.
    #[test]
    fn loss_weight_grad_sum_reads_from_older_configs_and_round_trips() {
        let mut json = serde_json::to_value(TrainConfig::default()).unwrap();
        let removed = json.as_object_mut().unwrap().remove("loss_weight_grad_sum");
        assert_eq!(removed, Some(serde_json::json!("chunks")));
        let older: TrainConfig = serde_json::from_value(json).unwrap();
        assert_eq!(
            older,
            TrainConfig {
                loss_weight_grad_sum: WeightGradSum::Exact,
                ..TrainConfig::default()
            }
        );
        let exact = TrainConfig {
            loss_weight_grad_sum: WeightGradSum::Exact,
            ..TrainConfig::default()
        };
        let json = serde_json::to_value(&exact).unwrap();
        assert_eq!(json["loss_weight_grad_sum"], "exact");
        assert_eq!(serde_json::from_value::<TrainConfig>(json).unwrap(), exact);
    }
}
