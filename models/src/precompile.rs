//! Compiling a training step's kernels in parallel, up front.
//!
//! A process that trains on a machine whose kernel cache is empty compiles
//! each kernel the first time the step launches it, one after the other:
//! on CUDA most of its start is NVRTC and the driver compiling some
//! hundred kernels in a row. [`Precompile::spawn`] starts this same
//! program again once per [`Part`] of the step, with [`PART_VAR`] naming
//! the part; each such worker runs only its part (the attention's
//! forward, its backward, the MLP, or a whole step of a model without
//! layers) for a one-layer model of the same architecture and sizes
//! ([`worker_config`]) on short rows, and exits. Their kernels reach the
//! training process through CubeCL's persistent compilation cache (see
//! [`bastile::kernel_cache`]), which that process reads again whenever it
//! adds a kernel of its own: a kernel a worker compiled before the step
//! needs it loads from disk instead of being compiled there. A kernel a
//! worker has not compiled yet is compiled by the training process as
//! before, so the workers never change what is computed, only where
//! kernels get compiled.
//!
//! A program that spawns workers must, before it builds its model, ask
//! [`worker_part`] whether it is one and then run [`run_part`] instead of
//! training (the benchmark's training child and the `bastile` command do).
//! Workers start only with the kernel cache on, never from a worker, not
//! when `BASTILE_PRECOMPILE=0`, and not again for a build of the program
//! whose first step of the same run already ended with this cache (a
//! marker file in the cache records it).
//!
//! The workers share the GPU with the training process until its first
//! step ends ([`Precompile::finish`] stops the ones still running): a
//! CUDA context each, and for the MLP's worker one layer's weights,
//! gradients and activations for 512 positions (GPT-OSS-20B's 32 experts
//! among them). A first step that needs nearly all of the GPU's memory
//! should run with `BASTILE_PRECOMPILE=0`.

use std::collections::hash_map::DefaultHasher;
use std::ffi::OsString;
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use bastile::BastileBackend;
use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor};

use crate::model::Layer;
use crate::train::{MicroBatch, TrainConfig, Trainer};
use crate::{CausalLm, HfConfig, ModelError};

/// The variable that tells a process it is a worker, and which part it
/// compiles ([`Part::name`]).
pub const PART_VAR: &str = "BASTILE_PRECOMPILE_PART";

/// `0` turns the workers off.
pub const PRECOMPILE_VAR: &str = "BASTILE_PRECOMPILE";

/// A directory where each worker writes what it prints, as
/// `<part>.log` ([`Part::name`]); without it their output is discarded.
pub const LOG_VAR: &str = "BASTILE_PRECOMPILE_LOG";

/// The longest rows a worker runs: its kernels are those of the full
/// length (they depend on the dtypes, the head and hidden sizes and the
/// alignment of the lengths, not on the lengths themselves), for less of
/// the GPU's memory.
pub const WORKER_SEQ: usize = 512;

/// The vocabulary of a worker's model: the loss's kernels are those of
/// any vocabulary of at least 512 vectors a row that is a multiple of 64
/// (the models' are), and its embedding and head stay small.
pub const WORKER_VOCAB: usize = 8192;

/// The MLP width of a worker's model whose part runs no MLP.
const SMALL_INTERMEDIATE: usize = 64;

/// What one worker runs of a training step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// The first layer's RoPE and attention, forward only (the attention
    /// first: its kernel takes longest to compile and the step needs it
    /// early).
    AttentionForward,
    /// The first layer's RoPE and attention, forward and backward.
    AttentionBackward,
    /// The first layer's MLP (or experts), forward and backward.
    Mlp,
    /// A whole training step of the model without its layer: the
    /// embedding, the final norm, the loss, their backward passes, the
    /// step's checks and the optimizer with its clip (on a small
    /// vocabulary: the optimizer's kernels depend on the parameters'
    /// dtypes and alignment, not their sizes).
    Step,
}

impl Part {
    /// Every part, the ones whose kernels the step needs last first.
    pub const ALL: [Part; 4] = [
        Part::Step,
        Part::AttentionBackward,
        Part::Mlp,
        Part::AttentionForward,
    ];

    /// Its value of [`PART_VAR`].
    pub fn name(self) -> &'static str {
        match self {
            Part::AttentionForward => "attention-forward",
            Part::AttentionBackward => "attention-backward",
            Part::Mlp => "mlp",
            Part::Step => "step",
        }
    }

    /// Whether [`run_part`] runs the weights of a model built for the
    /// part (the MLP and the step do; the attention parts initialize none).
    pub fn builds_model(self) -> bool {
        matches!(self, Part::Mlp | Part::Step)
    }

    fn from_name(name: &str) -> Option<Part> {
        Part::ALL.into_iter().find(|p| p.name() == name)
    }
}

/// The part this process compiles when [`Precompile::spawn`] started it;
/// `None` in any other process. An unknown part is an error.
pub fn worker_part() -> Result<Option<Part>, ModelError> {
    part_from(std::env::var_os(PART_VAR))
}

fn part_from(value: Option<OsString>) -> Result<Option<Part>, ModelError> {
    let Some(value) = value else {
        return Ok(None);
    };
    let name = value.to_string_lossy();
    Part::from_name(&name).map(Some).ok_or_else(|| {
        let known: Vec<&str> = Part::ALL.iter().map(|p| p.name()).collect();
        ModelError::Config(format!(
            "{PART_VAR}={name} names no part of a training step (known: {})",
            known.join(", ")
        ))
    })
}

/// The config a worker of `part` builds its model from: the first layer of
/// `config` (GPT-OSS runs its windowed and full layers through the same
/// kernels), a smaller vocabulary ([`WORKER_VOCAB`]), a narrow MLP where
/// the part runs none; the attention, the hidden size and everything else
/// as they are.
pub fn worker_config(config: &HfConfig, part: Part) -> HfConfig {
    let mut config = config.clone();
    config.num_hidden_layers = 1;
    if let Some(types) = &mut config.layer_types {
        types.truncate(1);
    }
    config.vocab_size = WORKER_VOCAB;
    if part != Part::Mlp {
        config.intermediate_size = SMALL_INTERMEDIATE;
    }
    config
}

/// A worker's micro-batch of `rows` rows of `seq` tokens, cut to
/// [`WORKER_SEQ`] positions: token 0 everywhere (the kernels do not depend
/// on the ids, and zeros need no random-number kernel, which the worker
/// would have to compile first).
pub fn plain_batch<B: AutodiffBackend>(
    rows: usize,
    seq: usize,
    device: &B::Device,
) -> MicroBatch<B> {
    let shape = [rows, seq.min(WORKER_SEQ)];
    MicroBatch {
        ids: Tensor::zeros(shape, device),
        labels: Tensor::zeros(shape, device),
        positions: None,
    }
}

/// A worker's micro-batch: `batch`'s rows cut to [`WORKER_SEQ`] positions.
pub fn worker_batch<B: AutodiffBackend>(batch: &MicroBatch<B>) -> MicroBatch<B> {
    let [_, s] = batch.ids.dims();
    let keep = s.min(WORKER_SEQ);
    MicroBatch {
        ids: batch.ids.clone().narrow(1, 0, keep),
        labels: batch.labels.clone().narrow(1, 0, keep),
        positions: batch.positions.clone().map(|p| p.narrow(1, 0, keep)),
    }
}

/// Runs `part` of a training step on `batch` ([`plain_batch`] or
/// [`worker_batch`]) and waits for the device to finish it. `build` makes
/// a model of a config as the training process makes its own (dtype,
/// adapters, expert routing), for the parts that run its weights: the MLP
/// and the step (whose ids are clamped into [`WORKER_VOCAB`]). The attention
/// parts run the first layer's RoPE and attention ([`Attention::attend`])
/// on uninitialized `dtype` projections instead, so they start without
/// initializing a model; their output goes through a product with a
/// `[heads · head_dim, hidden]` matrix, as the output projection's, so
/// the backward pass gets its gradient in the same layout.
///
/// [`Attention::attend`]: crate::attention::Attention::attend
pub fn run_part<B>(
    part: Part,
    config: &HfConfig,
    dtype: DType,
    build: impl FnOnce(&HfConfig) -> Result<CausalLm<B>, ModelError>,
    batch: MicroBatch<B>,
    train: TrainConfig,
) -> Result<(), ModelError>
where
    B: AutodiffBackend + BastileBackend,
    B::InnerBackend: BastileBackend,
    CausalLm<B>: AutodiffModule<B>,
{
    let device = batch.ids.device();
    let config = worker_config(config, part);
    let [b, s] = batch.ids.dims();
    let out = match part {
        Part::Step => {
            let mut model = build(&config)?;
            model.model.layers.clear();
            let top = model.config.vocab_size as i64 - 1;
            let ignore = bastile::CrossEntropyOptions::default().ignore_index;
            let batch = MicroBatch {
                ids: batch.ids.clamp(0, top),
                labels: batch.labels.clamp(ignore.min(0), top),
                positions: batch.positions,
            };
            let mut trainer = Trainer::<B>::new(train)?;
            let (_, out) = trainer.step(model, &[batch]);
            return out.map(|_| ());
        }
        Part::Mlp => {
            let model = build(&config)?;
            let layer = first_layer(&model)?;
            let x = Tensor::<B, 3>::empty([b, s, model.config.hidden_size], (&device, dtype))
                .require_grad();
            let router_load = model.router_aux_loss().is_some();
            let normed = layer.post_attention_layernorm.try_forward(x)?;
            let adapters = layer.lora.as_ref().map(|l| &l.mlp);
            let (out, _) = layer.mlp.forward(normed, adapters, router_load)?;
            out
        }
        Part::AttentionForward | Part::AttentionBackward => {
            // Parameters initialize lazily: none is touched here.
            let model = CausalLm::<B>::init(&config, &device)?;
            let attn = &first_layer(&model)?.self_attn;
            let (nh, nkv, d) = (attn.heads, attn.kv_heads, attn.head_dim);
            let input = |heads| {
                let t = Tensor::<B, 4>::empty([b, s, heads, d], (&device, dtype));
                if part == Part::AttentionBackward {
                    t.require_grad()
                } else {
                    t
                }
            };
            let sinks = attn
                .sinks
                .as_ref()
                .map(|_| Tensor::<B, 1>::empty([nh], (&device, dtype)));
            let positions = batch.positions.as_ref();
            if part == Part::AttentionForward {
                // The attention kernel first, the longest to compile: the
                // training process needs it early.
                attn.attend_rotated(input(nh), input(nkv), input(nkv), sinks.clone(), positions)?;
            }
            let tables = model.rope_tables(&batch.ids, positions);
            let out = attn.attend(input(nh), input(nkv), input(nkv), sinks, &tables, positions)?;
            let o_proj =
                Tensor::<B, 2>::empty([nh * d, model.config.hidden_size], (&device, dtype));
            out.matmul(o_proj.unsqueeze())
        }
    };
    if part != Part::AttentionForward {
        let _ = out.sum().backward();
    }
    B::sync(&device).map_err(|e| ModelError::Config(format!("the device failed: {e:?}")))
}

fn first_layer<B: BastileBackend>(model: &CausalLm<B>) -> Result<&Layer<B>, ModelError> {
    model
        .model
        .layers
        .first()
        .ok_or_else(|| ModelError::Config("the model has no layer to compile".into()))
}

/// The workers of one training process ([`Precompile::spawn`]).
pub struct Precompile {
    workers: Vec<(Part, Child)>,
    marker: PathBuf,
}

/// How the workers ended by the end of the first step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrecompileReport {
    /// Parts whose worker had finished.
    pub done: Vec<Part>,
    /// Parts whose worker was still running (stopped).
    pub stopped: Vec<Part>,
    /// Parts whose worker failed, with its exit status.
    pub failed: Vec<(Part, String)>,
}

impl Precompile {
    /// Starts one worker per part of `parts`: this program
    /// (`std::env::current_exe`) with its own arguments and [`PART_VAR`]
    /// set, its output discarded (or kept in [`LOG_VAR`]). `run` names
    /// what the program trains (model, shapes, dtypes, options). `None`
    /// (nothing started) in a worker, with `BASTILE_PRECOMPILE=0`, without the kernel cache
    /// ([`bastile::kernel_cache::kernel_cache_active`]), or when a first
    /// step of this build of the program training `run` already ended with
    /// this cache.
    pub fn spawn(parts: &[Part], run: &str) -> Option<Self> {
        if std::env::var_os(PART_VAR).is_some()
            || std::env::var_os(PRECOMPILE_VAR).is_some_and(|v| v == "0")
        {
            return None;
        }
        let cache = bastile::kernel_cache::kernel_cache_active()?;
        let exe = std::env::current_exe().ok()?;
        let args: Vec<OsString> = std::env::args_os().skip(1).collect();
        let marker = cache.join("precompiled").join(run_key(&exe, run));
        if marker.exists() {
            return None;
        }
        let log_dir = std::env::var_os(LOG_VAR).map(PathBuf::from);
        let log = |part: Part| {
            let dir = log_dir.as_ref()?;
            std::fs::create_dir_all(dir).ok()?;
            let file = std::fs::File::create(dir.join(format!("{}.log", part.name()))).ok()?;
            Some((Stdio::from(file.try_clone().ok()?), Stdio::from(file)))
        };
        let workers = parts
            .iter()
            .filter_map(|&part| {
                let (stdout, stderr) = log(part).unwrap_or((Stdio::null(), Stdio::null()));
                Command::new(&exe)
                    .args(&args)
                    .env(PART_VAR, part.name())
                    .stdin(Stdio::null())
                    .stdout(stdout)
                    .stderr(stderr)
                    .spawn()
                    .ok()
                    .map(|child| (part, child))
            })
            .collect();
        Some(Self { workers, marker })
    }

    /// The parts being compiled.
    pub fn parts(&self) -> Vec<Part> {
        self.workers.iter().map(|(p, _)| *p).collect()
    }

    /// After the first step ended: stops the workers still running (every
    /// kernel of the step is in the cache now) and marks the run as done,
    /// so the next start of this build training the same run spawns none.
    pub fn finish(mut self) -> PrecompileReport {
        let mut report = PrecompileReport::default();
        for (part, mut child) in std::mem::take(&mut self.workers) {
            match child.try_wait() {
                Ok(Some(status)) if status.success() => report.done.push(part),
                Ok(Some(status)) => report.failed.push((part, status.to_string())),
                Ok(None) | Err(_) => {
                    stop(&mut child);
                    report.stopped.push(part);
                }
            }
        }
        if let Some(dir) = self.marker.parent()
            && std::fs::create_dir_all(dir).is_ok()
        {
            let _ = std::fs::write(&self.marker, b"");
        }
        report
    }
}

impl Drop for Precompile {
    /// A training process that ends before its first step does takes its
    /// workers with it.
    fn drop(&mut self) {
        for (_, child) in &mut self.workers {
            stop(child);
        }
    }
}

/// Ends a worker (if it still runs) and reaps it.
fn stop(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// Names a program build and what it trains: the executable's path, size
/// and modification time (a rebuilt program compiles other kernels) and
/// `run`.
fn run_key(exe: &std::path::Path, run: &str) -> String {
    let mut hasher = DefaultHasher::new();
    exe.hash(&mut hasher);
    if let Ok(meta) = std::fs::metadata(exe) {
        meta.len().hash(&mut hasher);
        meta.modified().ok().hash(&mut hasher);
    }
    run.hash(&mut hasher);
    format!("{:016x}", hasher.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_reads_its_part_and_refuses_an_unknown_one() {
        assert_eq!(part_from(None).unwrap(), None);
        for part in Part::ALL {
            assert_eq!(part_from(Some(part.name().into())).unwrap(), Some(part));
        }
        let e = part_from(Some("attention".into())).unwrap_err().to_string();
        assert!(
            e.contains("=attention names no part") && e.contains("attention-forward"),
            "{e}"
        );
    }

    #[test]
    fn a_run_key_changes_with_the_run_and_the_program() {
        let exe = std::path::Path::new("/bin/sh");
        let a = run_key(exe, "qwen3-0.6b 1x4096 bf16");
        assert_eq!(a, run_key(exe, "qwen3-0.6b 1x4096 bf16"));
        assert_ne!(a, run_key(exe, "qwen3-0.6b 1x8192 bf16"));
        assert_ne!(
            a,
            run_key(std::path::Path::new("/bin/ls"), "qwen3-0.6b 1x4096 bf16")
        );
    }
}
