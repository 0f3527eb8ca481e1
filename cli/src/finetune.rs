//! `bastile finetune`: supervised finetuning on a JSONL instruction data
//! set, the prompt masked from the loss, with AdamW, gradient
//! accumulation, warmup + cosine learning rate, periodic checkpoints a run
//! resumes from (see [`crate::checkpoint`]) and a final Hugging Face
//! export.

use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bastile::launch_failure::out_of_memory;
use bastile::{BastileBackend, WeightGradSum};
use bastile_models::precompile::{self, Part, Precompile};
use bastile_models::{
    CausalLm, Checkpointing, Collective, DataParallelOptions, ExpertRouting, LoraConfig,
    MicroBatch, ModelError, OptimizerKind, TrainConfig, Trainer,
};
use burn::module::Module;
use burn::tensor::backend::{AutodiffBackend, Backend};
use indicatif::{ProgressBar, ProgressStyle};

use crate::batches::{Batcher, Sampler, packed_rows};
use crate::chat::ChatFormat;
use crate::checkpoint::{RunSettings, RunState, fingerprint, prune, write_dir_atomically};
use crate::data;
use crate::device::{DeviceKind, RunInfo, Task, dispatch_data_parallel};
use crate::eval::hold_out;
use crate::source::{ModelSource, RECORD, is_adapter_dir, recorder};
use crate::{CliError, DTypeArg};

/// Everything `finetune` is told (the command line's options).
#[derive(Clone, Debug)]
pub struct FinetuneOptions {
    /// A preset name or a model directory.
    pub model: String,
    pub tokenizer: Option<PathBuf>,
    /// JSONL data; the embedded data set when `None`.
    pub data: Option<PathBuf>,
    /// JSONL evaluation data, tokenized like the training data.
    pub eval_data: Option<PathBuf>,
    /// Hold this fraction of the training examples out for evaluation.
    pub eval_fraction: Option<f64>,
    /// Report the evaluation loss every this many steps (and at the end).
    pub eval_every: Option<usize>,
    pub chat_format: Option<ChatFormat>,
    pub output: PathBuf,
    /// Longer examples are cut to this many tokens.
    pub max_seq: Option<usize>,
    /// Rows (packed) or examples (not packed) per micro-batch.
    pub batch_size: usize,
    /// Pack whole examples into rows as long as the longest example (each
    /// attending only to itself); else one example per row, padded.
    pub packing: bool,
    /// Pad batches to a multiple of this length (default: the device's
    /// [`RunInfo::pad_multiple`]).
    pub pad_to_multiple: Option<usize>,
    pub grad_accum: usize,
    /// Passes over the data (default: 60 for the tiny preset, which
    /// starts from random weights, else 3).
    pub epochs: Option<usize>,
    /// Optimizer steps; `epochs` decides when `None`.
    pub steps: Option<usize>,
    pub learning_rate: Option<f64>,
    pub warmup_steps: Option<usize>,
    pub weight_decay: f32,
    pub max_grad_norm: Option<f32>,
    pub optimizer: OptimizerKind,
    /// f32 moments and master weights for half-precision parameters.
    pub master_weights: bool,
    /// How the fused loss sums the output layer's gradient over its chunks.
    pub loss_weight_grad_sum: WeightGradSum,
    /// Write a checkpoint every this many steps.
    pub save_every: Option<usize>,
    /// Keep only this many of the latest checkpoints.
    pub keep_last: Option<usize>,
    /// Skip a step whose loss or gradient is not finite (with a warning)
    /// instead of stopping; [`MAX_SKIPPED_IN_A_ROW`] in a row still stop.
    pub skip_nonfinite: bool,
    /// Continue the run that wrote this checkpoint directory: the model,
    /// tokenizer, optimizer state, step, schedule and data position come
    /// from it (`model` is not read); the options must be the run's.
    pub resume: Option<PathBuf>,
    pub dtype: DTypeArg,
    pub seed: u64,
    /// Draw a progress bar (else a line every `log_every` steps).
    pub progress: bool,
    pub log_every: usize,
    /// Train LoRA adapters on the frozen model instead of every weight
    /// (the base model is recorded as `model`). A `model` that is already
    /// an adapter directory trains its adapters without this.
    pub lora: Option<LoraConfig>,
    /// With adapters, also write `final-merged/`: the adapters folded into
    /// the weights, as an HF checkpoint.
    pub merge_lora: bool,
    /// CUDA GPUs to train on data-parallel (1: the one `--device` picks):
    /// each step takes `grad_accum` micro-batches per GPU.
    pub devices: usize,
    /// Which layers recompute their activations in the backward pass.
    pub checkpointing: Checkpointing,
    /// How a mixture of experts runs them (`None`: the model's default,
    /// routed; a setting is an error for a model without experts).
    pub expert_routing: Option<ExpertRouting>,
    /// The weight of the router's load-balancing loss in the training loss
    /// (`Some(0.0)`: none; `None`: as the model's `config.json` says); an
    /// error for a model without experts.
    pub router_aux_loss: Option<f64>,
    /// Record a step as CUDA graphs and replay it for the steps of its
    /// shapes (`Trainer::with_step_graphs`; one GPU).
    pub step_graphs: bool,
}

/// What a finetuning run did.
#[derive(Clone, Debug)]
pub struct FinetuneReport {
    /// The loss of every optimizer step (a resumed run's include the
    /// steps before the checkpoint).
    pub losses: Vec<f64>,
    /// Tokens trained on (padding excluded).
    pub tokens: usize,
    pub seconds: f64,
    /// The checkpoints this process wrote that are still there.
    pub checkpoints: Vec<PathBuf>,
    /// The HF export of the final model (with LoRA: its adapters, in
    /// PEFT's format).
    pub final_dir: PathBuf,
    /// With LoRA and `merge_lora`: the merged model's HF export.
    pub merged_dir: Option<PathBuf>,
    pub truncated: usize,
    pub dropped: usize,
    /// Batches skipped for a loss or gradient that was not finite.
    pub skipped: usize,
    /// `(step, loss)` of every evaluation (with an evaluation set).
    pub eval_losses: Vec<(usize, f64)>,
}

/// Non-finite steps in a row after which `--skip-nonfinite` stops anyway:
/// the run has diverged rather than met a bad batch.
pub const MAX_SKIPPED_IN_A_ROW: usize = 8;

pub struct Finetune(pub FinetuneOptions);

/// `bastile finetune`: trains on the backend `device` and `bastile` select
/// (see [`crate::device::dispatch`]), on `options.devices` CUDA GPUs
/// data-parallel when above 1. Not generic, so the training code is compiled once,
/// here, for every backend, rather than again in each caller.
pub fn run(
    device: DeviceKind,
    bastile: bool,
    options: FinetuneOptions,
) -> Result<FinetuneReport, CliError> {
    let devices = options.devices;
    dispatch_data_parallel(device, bastile, devices, Finetune(options))
}

impl Task for Finetune {
    type Output = FinetuneReport;

    fn models(&self) -> Vec<String> {
        // A resumed run trains the checkpoint's model (`model` is not read).
        match &self.0.resume {
            Some(dir) => vec![dir.to_string_lossy().into_owned()],
            None => vec![self.0.model.clone()],
        }
    }

    fn run<B>(self, device: B::Device, info: RunInfo) -> Result<FinetuneReport, CliError>
    where
        B: AutodiffBackend + BastileBackend,
        B::InnerBackend: BastileBackend,
    {
        let devices = vec![device.clone()];
        self.train::<B>(device, info, |trainer, _| Ok((trainer, devices)))
    }

    fn run_data_parallel<B>(
        self,
        devices: Vec<B::Device>,
        collective: Collective<B::InnerBackend>,
        info: RunInfo,
    ) -> Result<FinetuneReport, CliError>
    where
        B: AutodiffBackend + BastileBackend,
        B::InnerBackend: BastileBackend,
        CausalLm<B>: Send + 'static,
        MicroBatch<B>: Send,
    {
        let first = devices[0].clone();
        self.train::<B>(first, info, move |trainer, model| {
            let options = DataParallelOptions::default();
            let trainer = trainer.data_parallel(model, &devices, collective, options)?;
            Ok((trainer, devices))
        })
    }
}

impl Finetune {
    /// The run on `device`; `parallel` makes the trainer data-parallel
    /// (or returns it as it is) once the model is loaded, with every
    /// worker's device (`device` first).
    fn train<B>(
        self,
        device: B::Device,
        info: RunInfo,
        parallel: impl FnOnce(
            Trainer<B>,
            &CausalLm<B>,
        ) -> Result<(Trainer<B>, Vec<B::Device>), CliError>,
    ) -> Result<FinetuneReport, CliError>
    where
        B: AutodiffBackend + BastileBackend,
        B::InnerBackend: BastileBackend,
    {
        let o = self.0;
        check_options(&o)?;
        prepare_output(&o.output)?;
        let resumed = match &o.resume {
            Some(dir) => Some((dir.clone(), RunState::load(dir)?)),
            None => None,
        };
        let source = match &resumed {
            Some((dir, _)) => ModelSource::Dir(dir.clone()),
            None => ModelSource::parse(&o.model)?,
        };
        let tokenizer = source.tokenizer(o.tokenizer.as_deref())?;
        B::seed(&device, o.seed);
        // A worker compiles a part of the step on a model of the same
        // config with random weights (the kernels do not depend on them).
        let worker = precompile::worker_part()?;
        // On a machine that has not run this model before, workers compile
        // the step's kernels while the weights load and the first step runs.
        let mut workers = (worker.is_none()
            && info.bastile
            && info.device == DeviceKind::Cuda
            && o.devices == 1
            && resumed.is_none())
        .then(|| {
            // What the run trains is in its arguments.
            let args: Vec<String> = std::env::args().skip(1).collect();
            Precompile::spawn(&Part::ALL, &args.join(" "))
        })
        .flatten();
        let loading = Instant::now();
        let model = match worker {
            Some(part) => {
                CausalLm::<B>::init(&precompile::worker_config(&source.config()?, part), &device)?
            }
            None => source.load::<B>(&device)?,
        };
        let weights_seconds = loading.elapsed().as_secs_f64();
        if worker.is_none() {
            tokenizer.check_fits(model.config.vocab_size)?;
        }
        let format = o
            .chat_format
            .unwrap_or_else(|| ChatFormat::for_model(model.config.architecture, &tokenizer));
        let conversations = match &o.data {
            Some(path) => data::load(path)?,
            None => data::parse(data::EMBEDDED, Path::new("<embedded data set>"))?,
        };
        let max_len = o.max_seq.unwrap_or(model.config.max_positions.min(2048));
        let mut set = data::tokenize(&conversations, format, &tokenizer, max_len)?;
        if set.truncated > 0 {
            eprintln!(
                "warning: {} of {} examples are longer than {max_len} tokens and were truncated \
                 (--max-seq sets the limit)",
                set.truncated,
                conversations.len()
            );
        }
        if set.dropped > 0 {
            eprintln!(
                "warning: {} examples had no reply left to train on after truncation and were skipped",
                set.dropped
            );
        }
        if set.examples.is_empty() {
            return Err(CliError::Usage(
                "no example has a reply to train on within --max-seq tokens".into(),
            ));
        }
        let eval_examples = match (&o.eval_data, o.eval_fraction) {
            (Some(_), Some(_)) => {
                return Err(CliError::Usage(
                    "--eval-data and --eval-fraction both name an evaluation set: pass one".into(),
                ));
            }
            (Some(path), None) => {
                let eval = data::tokenize(&data::load(path)?, format, &tokenizer, max_len)?;
                if eval.examples.is_empty() {
                    return Err(CliError::io(
                        path,
                        "no example has a reply to evaluate within --max-seq tokens",
                    ));
                }
                eval.examples
            }
            (None, Some(fraction)) => {
                let (train, eval) = hold_out(std::mem::take(&mut set.examples), fraction, o.seed)?;
                set.examples = train;
                eval
            }
            (None, None) => Vec::new(),
        };
        let dtype = o.dtype.resolve(&info)?;
        // The attention parts of a worker touch no weight of the model,
        // which then stays uninitialized.
        let model = match worker {
            Some(part) if !part.builds_model() => model,
            _ => model.with_dtype(dtype)?,
        };
        let model = match (&o.lora, model.lora_config()) {
            (Some(config), None) => {
                let base = source.name();
                model.with_lora(config.clone().with_base_model(Some(base)), &device)?
            }
            // A resumed run's adapters come from its checkpoint; the
            // settings check below holds them to the options.
            (Some(_), Some(_)) if resumed.is_some() => model,
            (Some(_), Some(_)) => {
                return Err(CliError::Usage(format!(
                    "{} is a LoRA adapter directory: its adapters train without --lora-rank \
                     (or pass its base model to train new ones)",
                    o.model
                )));
            }
            (None, _) => model,
        };
        let mut model = model.with_checkpointing(o.checkpointing)?;
        if let Some(routing) = o.expert_routing {
            model = model.with_expert_routing(routing)?;
        }
        if let Some(coef) = o.router_aux_loss {
            model = model.with_router_aux_loss((coef != 0.0).then_some(coef))?;
        }
        let per_step = o.batch_size * o.grad_accum * o.devices;
        let multiple = o.pad_to_multiple.unwrap_or(info.pad_multiple());
        // Packed rows hold the longest example (rounded up to the padding
        // multiple, within --max-seq): no batch needs more memory than the
        // padded batch of that example would.
        let longest = set.examples.iter().chain(&eval_examples);
        let longest = longest.map(|e| e.ids.len()).max().unwrap_or(1);
        let row_len = longest.next_multiple_of(multiple.max(1)).min(max_len);
        // What an epoch fills: examples, or the rows packing them in order
        // fills (the shuffled order packs about as tightly).
        let epoch_units = if o.packing {
            let lengths: Vec<usize> = set.examples.iter().map(|e| e.ids.len()).collect();
            packed_rows(&lengths, row_len)
        } else {
            set.examples.len()
        };
        // A resumed run's defaults are the schedule it was started with
        // (the checkpoint is no longer the preset whose defaults those were).
        let saved = resumed.as_ref().map(|(_, state)| &state.config);
        let epochs = o.epochs.unwrap_or(if source.is_tiny() { 60 } else { 3 });
        let steps = o
            .steps
            .or(saved.map(|c| c.total_steps))
            .unwrap_or_else(|| (epochs * epoch_units).div_ceil(per_step));
        let default_lr = if source.is_tiny() { 3e-3 } else { 2e-5 };
        let learning_rate = o.learning_rate.or(saved.map(|c| c.learning_rate));
        let warmup_steps = o.warmup_steps.or(saved.map(|c| c.warmup_steps));
        let config = TrainConfig {
            learning_rate: learning_rate.unwrap_or(default_lr),
            warmup_steps: warmup_steps.unwrap_or(steps / 20).min(steps),
            total_steps: steps,
            weight_decay: o.weight_decay,
            max_grad_norm: o.max_grad_norm,
            optimizer: o.optimizer,
            master_weights: o.master_weights,
            loss_weight_grad_sum: o.loss_weight_grad_sum,
            ..Default::default()
        };
        let settings = RunSettings {
            batch_size: o.batch_size,
            grad_accum: o.grad_accum,
            seed: o.seed,
            pad_multiple: multiple,
            packed_length: o.packing.then_some(row_len),
            dtype: format!("{dtype:?}"),
            lora: o.lora.as_ref().map(lora_setting),
            examples: set.examples.len(),
            data: fingerprint(&set.examples),
            devices: o.devices,
        };
        let (mut trainer, devices) = parallel(Trainer::<B>::new(config)?, &model)?;
        if o.step_graphs {
            trainer = trainer.with_step_graphs()?;
        }
        let mut sampler = Sampler::new(set.examples.len(), o.seed);
        let mut report = FinetuneReport {
            losses: Vec::with_capacity(steps),
            tokens: 0,
            seconds: 0.0,
            checkpoints: Vec::new(),
            final_dir: o.output.join("final"),
            merged_dir: None,
            truncated: set.truncated,
            dropped: set.dropped,
            skipped: 0,
            eval_losses: Vec::new(),
        };
        let mut drawn = 0;
        let mut earlier_seconds = 0.0;
        if let Some((dir, state)) = &resumed {
            state.check_resumes(&settings, &trainer.config, dir)?;
            let loading = Instant::now();
            trainer = trainer.load_state(dir, &device)?;
            let state_seconds = loading.elapsed().as_secs_f64();
            if trainer.steps() != state.step {
                return Err(CliError::io(
                    dir,
                    format!(
                        "run.json is at step {} but the trainer state at step {}",
                        state.step,
                        trainer.steps()
                    ),
                ));
            }
            let skipping = Instant::now();
            sampler.pass_over(state.examples_drawn);
            let skip_seconds = skipping.elapsed().as_secs_f64();
            drawn = state.examples_drawn;
            earlier_seconds = state.seconds;
            report.losses.clone_from(&state.losses);
            report.eval_losses.clone_from(&state.eval_losses);
            report.tokens = state.tokens;
            eprintln!(
                "resuming from {} at step {} of {steps} (weights loaded in {weights_seconds:.2} s, \
                 optimizer state in {state_seconds:.2} s, data position in {:.1} ms)",
                dir.display(),
                state.step,
                skip_seconds * 1e3
            );
        }
        let done = trainer.steps();
        let mut trained = model.lora_config().map_or(String::new(), |c| {
            format!(", LoRA {} (base frozen)", lora_setting(c))
        });
        if model.checkpointing != Checkpointing::Off {
            trained += &format!(", activation checkpointing of {}", model.checkpointing);
        }
        match model.expert_routing() {
            Some(ExpertRouting::Routed) => trained += ", routed experts",
            Some(ExpertRouting::Dense) => trained += ", dense experts",
            None => {}
        }
        if let Some(coef) = model.router_aux_loss() {
            trained += &format!(", router load-balancing loss x{coef}");
        }
        let rows = if o.packing {
            format!("rows of {row_len} tokens, each packing whole examples")
        } else {
            "examples, one per row".into()
        };
        eprintln!(
            "finetuning {} ({} layers, hidden {}) on {}: {} examples, {steps} steps of \
             {} x {} {rows}, {dtype:?}, {format:?} chat format{trained}",
            source.name(),
            model.config.layers,
            model.config.hidden_size,
            info.describe(),
            set.examples.len(),
            o.grad_accum,
            o.batch_size,
        );
        let bar = progress_bar(steps as u64, o.progress);
        bar.set_position(done as u64);
        // The tokenizer files to copy into checkpoints: the model
        // directory's, unless another tokenizer was named.
        let tokenizer_dir = if o.tokenizer.is_some() {
            None
        } else {
            source.dir()
        };
        let pad_id = tokenizer.pad_id();
        let batcher = Batcher {
            packing: o.packing,
            rows: o.batch_size,
            row_len,
            pad_id,
            multiple,
        };
        if let Some(part) = worker {
            let mut order = sampler.peekable();
            let (batch, _) = batcher
                .next(&mut order, &set.examples)
                .expect("the sampler never ends");
            let batch = precompile::worker_batch(&batch.to_device(&device));
            // The model is the worker's already, built from `worker_config`
            // (which leaves a worker's config as it is).
            let config = model.hf_config.clone();
            let train = trainer.config.clone();
            precompile::run_part(part, &config, dtype, |_| Ok(model), batch, train)?;
            std::process::exit(0);
        }
        let mut eval_order = (0..eval_examples.len()).peekable();
        let eval_batches: Vec<MicroBatch<B>> =
            std::iter::from_fn(|| batcher.next(&mut eval_order, &eval_examples))
                .map(|(batch, _)| batch.to_device(&device))
                .collect();
        let mut order = sampler.peekable();
        let mut eval_status = String::new();
        let start = Instant::now();
        let tokens_before = report.tokens;
        let gpu = info.device != DeviceKind::Cpu;
        if gpu {
            // The first step compiles every kernel it meets: tens of seconds
            // on a machine that has not run this model before (minutes with
            // BASTILE_TUNE=full), without a sign of life unless said so.
            let mut note = "the first step compiles the kernels (tens of seconds the first time \
                            on a machine, about a second once cached; `bastile warmup` compiles \
                            them ahead)"
                .to_string();
            if let Some(w) = &workers {
                note += &format!(
                    "; {} worker processes compile parts of it beside this one",
                    w.parts().len()
                );
            }
            if o.progress {
                bar.set_message(note);
                bar.enable_steady_tick(Duration::from_millis(500));
            } else {
                eprintln!("{note}");
            }
        }
        let mut skipped_in_a_row = 0;
        while trainer.steps() < steps {
            let step = trainer.steps() + 1;
            // Data-parallel: `grad_accum` micro-batches for each GPU, in
            // order, each put on its GPU (the trainer shares them out).
            let mut micro = Vec::with_capacity(o.grad_accum * o.devices);
            let mut batch_tokens = 0;
            for i in 0..o.grad_accum * o.devices {
                let (batch, count) = batcher
                    .next(&mut order, &set.examples)
                    .expect("the sampler never ends");
                drawn += count;
                batch_tokens += batch.tokens;
                micro.push(batch.to_device(&devices[i / o.grad_accum]));
            }
            // Out of device memory, the step fails (or its read panics)
            // and the device is not used again: the run ends naming it.
            let stepped =
                std::panic::catch_unwind(AssertUnwindSafe(|| trainer.step(model, &micro)));
            if let Some(bytes) = out_of_memory() {
                let [rows, length] = micro
                    .iter()
                    .map(|m| m.ids.dims())
                    .max_by_key(|[rows, length]| rows * length)
                    .expect("a step has micro-batches");
                return Err(CliError::OutOfMemory {
                    step,
                    rows,
                    length,
                    bytes,
                });
            }
            let (m, out) = stepped.unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            model = m;
            // Every kernel of the step is compiled (and cached) by now.
            drop(workers.take().map(Precompile::finish));
            let out = match out {
                Err(e @ ModelError::NonFinite { .. })
                    if o.skip_nonfinite && skipped_in_a_row < MAX_SKIPPED_IN_A_ROW =>
                {
                    skipped_in_a_row += 1;
                    report.skipped += 1;
                    bar.println(format!("warning: {e}; its batch is passed over"));
                    continue;
                }
                Err(e @ ModelError::NonFinite { .. }) if o.skip_nonfinite => {
                    return Err(CliError::Usage(format!(
                        "{e}: {MAX_SKIPPED_IN_A_ROW} steps in a row before it were not finite \
                         either, so training stops (a lower --lr or --max-grad-norm may help)"
                    )));
                }
                out => out?,
            };
            skipped_in_a_row = 0;
            report.tokens += batch_tokens;
            report.losses.push(out.loss);
            let rate = (report.tokens - tokens_before) as f64 / start.elapsed().as_secs_f64();
            if !eval_batches.is_empty()
                && (step == steps || o.eval_every.is_some_and(|n| step % n == 0))
            {
                let loss = Trainer::evaluate(&model, &eval_batches)?;
                report.eval_losses.push((step, loss));
                eval_status = format!("  eval {loss:.4}");
                let line = format!("step {step:>5}/{steps}  eval loss {loss:.4}");
                if o.progress {
                    bar.println(line);
                } else {
                    eprintln!("{line}");
                }
            }
            let status = format!(
                "loss {:.4}{eval_status}  lr {:.2e}  {rate:.0} tok/s",
                out.loss, out.learning_rate
            );
            if !o.progress && (step % o.log_every == 0 || step == steps) {
                eprintln!("step {step:>5}/{steps}  {status}");
            }
            if step == done + 1 && gpu {
                let first = format!(
                    "step {step} took {:.1} s, compiling and tuning included",
                    start.elapsed().as_secs_f64()
                );
                if o.progress {
                    bar.disable_steady_tick();
                    bar.println(first);
                } else {
                    eprintln!("{first}");
                }
            }
            bar.set_message(status);
            bar.inc(1);
            if o.save_every.is_some_and(|n| step % n == 0 && step < steps) {
                let dir = o.output.join(format!("checkpoint-{step}"));
                let state = RunState {
                    step,
                    config: trainer.config.clone(),
                    examples_drawn: drawn,
                    tokens: report.tokens,
                    seconds: earlier_seconds + start.elapsed().as_secs_f64(),
                    losses: report.losses.clone(),
                    eval_losses: report.eval_losses.clone(),
                    settings: settings.clone(),
                };
                write_dir_atomically(&dir, |d| {
                    save_checkpoint(&model, &tokenizer, tokenizer_dir, d)?;
                    trainer.save_state(d)?;
                    state.save(d)
                })?;
                bar.println(format!("saved {}", dir.display()));
                report.checkpoints.push(dir);
                if let Some(keep) = o.keep_last {
                    // The checkpoint resumed from holds the tokenizer files
                    // later checkpoints copy: it stays.
                    let resumed_from = o.resume.as_deref();
                    for gone in prune(&o.output, keep, resumed_from)? {
                        report.checkpoints.retain(|c| *c != gone);
                    }
                }
            }
        }
        bar.finish();
        report.seconds = earlier_seconds + start.elapsed().as_secs_f64();
        write_dir_atomically(&report.final_dir, |d| {
            save_model(&model, d)?;
            tokenizer.save_beside(tokenizer_dir, d)
        })?;
        if o.merge_lora && model.lora_config().is_some() {
            let dir = o.output.join("final-merged");
            write_dir_atomically(&dir, |d| {
                model.clone().merge_lora().save_hf_dir(d)?;
                tokenizer.save_beside(tokenizer_dir, d)
            })?;
            report.merged_dir = Some(dir);
        }
        let first = report.losses.first().copied().unwrap_or(f64::NAN);
        let last = report.losses.last().copied().unwrap_or(f64::NAN);
        eprintln!(
            "done: {steps} steps in {:.1} s ({:.0} tokens/s), loss {first:.4} -> {last:.4}; \
             model saved to {}",
            report.seconds,
            report.tokens as f64 / report.seconds.max(f64::MIN_POSITIVE),
            report.final_dir.display()
        );
        Ok(report)
    }
}

fn check_options(o: &FinetuneOptions) -> Result<(), CliError> {
    let positive = [
        ("--batch-size", o.batch_size),
        ("--grad-accum", o.grad_accum),
        ("--pad-to-multiple", o.pad_to_multiple.unwrap_or(1)),
        ("--log-every", o.log_every),
        ("--max-seq", o.max_seq.unwrap_or(2)),
        ("--save-every", o.save_every.unwrap_or(1)),
        ("--keep-last", o.keep_last.unwrap_or(1)),
        ("--eval-every", o.eval_every.unwrap_or(1)),
        ("--devices", o.devices),
        ("--steps", o.steps.unwrap_or(1)),
        ("--epochs", o.epochs.unwrap_or(1)),
    ];
    if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
        return Err(CliError::Usage(format!("{name} must be at least 1")));
    }
    if o.merge_lora && o.lora.is_none() && o.resume.is_none() && !is_adapter_dir(&o.model) {
        return Err(CliError::Usage(
            "--merge-lora merges LoRA adapters: train some with --lora-rank".into(),
        ));
    }
    if o.max_seq == Some(1) {
        return Err(CliError::Usage(
            "--max-seq must be at least 2 (a token and the one it predicts)".into(),
        ));
    }
    Ok(())
}

/// Creates the output directory and proves it writable before any
/// training time is spent.
fn prepare_output(dir: &Path) -> Result<(), CliError> {
    std::fs::create_dir_all(dir).map_err(|e| CliError::io(dir, e))?;
    let probe = dir.join(".bastile-write-test");
    std::fs::write(&probe, b"").map_err(|e| CliError::io(dir, format!("not writable: {e}")))?;
    std::fs::remove_file(&probe).map_err(|e| CliError::io(&probe, e))
}

/// A checkpoint: `config.json`, the model and the tokenizer, which
/// `finetune --model` and `generate --model` load again. The model is the
/// Burn record, or with LoRA only the adapters, in PEFT's format (their
/// parameter ids follow from their place, so the optimizer state applies
/// to them again).
fn save_checkpoint<B: AutodiffBackend>(
    model: &CausalLm<B>,
    tokenizer: &crate::tokenizer::Tokenizer,
    source: Option<&Path>,
    dir: &Path,
) -> Result<(), CliError> {
    model.save_config(dir)?;
    if model.lora_config().is_some() {
        model.save_adapter_dir(dir)?;
    } else {
        model
            .clone()
            .save_file(dir.join(RECORD), &recorder())
            .map_err(|e| CliError::io(dir.join(RECORD), e))?;
    }
    tokenizer.save_beside(source, dir)
}

/// The final model: an HF checkpoint, or with LoRA `config.json` and the
/// adapters in PEFT's format.
fn save_model<B: Backend>(model: &CausalLm<B>, dir: &Path) -> Result<(), CliError> {
    if model.lora_config().is_some() {
        model.save_config(dir)?;
        Ok(model.save_adapter_dir(dir)?)
    } else {
        Ok(model.save_hf_dir(dir)?)
    }
}

/// What a resumed run's LoRA options must equal: rank, alpha, dropout,
/// rsLoRA and targets.
fn lora_setting(c: &LoraConfig) -> String {
    let targets: Vec<_> = c.targets.iter().map(|t| t.hf_name()).collect();
    format!(
        "rank {}, alpha {}, dropout {}, rslora {}, targets {}",
        c.rank,
        c.alpha,
        c.dropout,
        c.rslora,
        targets.join(",")
    )
}

fn progress_bar(steps: u64, visible: bool) -> ProgressBar {
    if !visible {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(steps);
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:30.cyan/blue} {pos}/{len} steps  {msg}  [{elapsed_precise} < {eta_precise}]",
        )
        .expect("a valid template"),
    );
    bar
}
