//! End-to-end training steps: a model preset with random weights in bf16
//! (f32 on the software Vulkan device), AdamW, one micro-batch per step
//! (random tokens filling every row, or an instruction data set padded or
//! packed: [`DataLayout`]); milliseconds per step, trained tokens per
//! second and device memory.
//!
//! Each (implementation, batch, sequence) runs in a process of its own (the
//! binary runs itself again with `--impl`), so every memory reading starts
//! from an empty pool and an out-of-memory failure is recorded as such
//! instead of ending the sweep.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bastile::launch_failure::{allocation_failure, out_of_memory_message};
use bastile::{Bastile, BastileBackend, Patches, WeightGradSum};
use bastile_cli::device::{CudaBackend, model_routes_experts};
use bastile_cli::warmup::random_batch;
use bastile_models::precompile::{self, Part, Precompile};
use bastile_models::{
    CausalLm, Checkpointing, ExpertRouting, HfConfig, LoraConfig, MicroBatch, TrainConfig, Trainer,
    presets,
};
use burn::backend::Autodiff;
use burn::tensor::DType;
use burn::tensor::backend::AutodiffBackend;
use clap::ValueEnum;
use serde::{Deserialize, Serialize};

use crate::packing::{DataLayout, micro_batches};
use crate::report::Report;
use crate::{Args, progress};

/// What trains.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TrainImpl {
    /// `Autodiff<B>`: Burn's own ops and matmul.
    Burn,
    /// `Autodiff<Bastile<B>>` with the fused ops but Burn's matmul.
    BastileKernels,
    /// `Autodiff<Bastile<B>>`, every patch on (cuBLASLt matmul on CUDA).
    Bastile,
}

impl TrainImpl {
    pub fn name(self) -> &'static str {
        match self {
            Self::Burn => "burn",
            Self::BastileKernels => "bastile (Burn matmul)",
            Self::Bastile => "bastile",
        }
    }
}

/// One training configuration's result.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrainRow {
    pub model: String,
    pub batch: usize,
    pub seq: usize,
    pub dtype: String,
    pub implementation: String,
    /// Median over the timed steps; `None` when the run failed.
    pub ms_per_step: Option<f64>,
    /// The fastest and the slowest timed step, ms: the median's spread.
    #[serde(default)]
    pub ms_range: Option<(f64, f64)>,
    pub tokens_per_s: Option<f64>,
    /// Reserved device memory (the allocator's pool) after the timed steps.
    pub peak_mib: Option<f64>,
    /// Peak bytes in use during a step: PyTorch's `max_memory_allocated`;
    /// for Bastile and Burn the largest of CubeCL's bytes in use, read
    /// back to back by another thread during an extra step after the
    /// timed ones.
    #[serde(default)]
    pub in_use_mib: Option<f64>,
    /// Wall time of the first step, compilation and tuning included (with
    /// whatever caches the machine held).
    #[serde(default)]
    pub first_step_s: Option<f64>,
    /// Seconds from the measuring process's start to the end of step 0
    /// (building the model, compiling and tuning included), with the
    /// caches an earlier process of the same configuration left (Bastile
    /// and Burn; with `--no-cold-start`, whatever caches the machine held).
    #[serde(default)]
    pub start_s: Option<f64>,
    /// The same in a process whose caches were empty: compiled kernels,
    /// the GPU driver's compiled code and autotune results.
    #[serde(default)]
    pub cold_start_s: Option<f64>,
    /// Median host time to queue a timed step (Bastile and Burn).
    #[serde(default)]
    pub host_ms: Option<f64>,
    /// Why the run failed (out of memory, ...).
    pub error: Option<String>,
    /// GPUs training data-parallel, one micro-batch of `batch` × `seq`
    /// each (`tokens_per_s` counts all of them; memory is the first GPU's).
    #[serde(default = "one_device")]
    pub devices: usize,
    /// Where the memory in use goes (Bastile and Burn, one GPU, without
    /// checkpointing).
    #[serde(default)]
    pub memory: Option<MemoryBreakdown>,
}

/// Where a step's memory goes, in MiB of CubeCL's bytes in use: measured
/// on one more forward and backward pass after the timed steps, each
/// phase read after a device sync.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct MemoryBreakdown {
    /// The model's parameters (their count × the dtype's size).
    pub parameters_mib: f64,
    /// In use between steps beyond the parameters: the optimizer's state
    /// (and the micro-batch's ids and labels).
    pub optimizer_state_mib: f64,
    /// Added by the forward pass and kept for the backward pass: the
    /// activations the graph saves (with the fused loss, also the loss's
    /// gradients, which it computes in the forward pass).
    pub forward_kept_mib: f64,
    /// Held after the backward pass: the gradients.
    pub gradients_mib: f64,
    /// The most in use during the forward and backward pass, over what is
    /// in use between steps (sampled, a lower bound).
    pub pass_peak_mib: f64,
}

impl TrainRow {
    /// A row of one configuration with nothing measured.
    fn unmeasured(
        model: &str,
        (batch, seq): (usize, usize),
        dtype: &str,
        imp: TrainImpl,
        devices: usize,
    ) -> Self {
        TrainRow {
            model: model.into(),
            batch,
            seq,
            dtype: dtype.into(),
            implementation: imp.name().into(),
            ms_per_step: None,
            ms_range: None,
            tokens_per_s: None,
            peak_mib: None,
            in_use_mib: None,
            first_step_s: None,
            start_s: None,
            cold_start_s: None,
            host_ms: None,
            error: None,
            memory: None,
            devices,
        }
    }
}

fn one_device() -> usize {
    1
}

const MIB: f64 = (1u64 << 20) as f64;

/// The line prefix a child process reports its row with.
const ROW_TAG: &str = "BASTILE_TRAIN_ROW ";

/// The models of the default training suite.
pub const SUITE: [&str; 4] = ["qwen3-0.6b", "qwen3-1.7b", "llama-3.2-1b", "gpt-oss-20b-4l"];
/// The default suite's model on the software Vulkan device.
pub const TINY_SUITE: [&str; 1] = [presets::TINY];

/// The sequence lengths a sweep tries, in order: the given ones, or
/// 1024, 2048, 4096, 8192 and on by doubling up to `cap` (the model's
/// context or `--max-seq`). The sweep stops early once every
/// implementation has failed (out of memory) at a shorter length.
pub fn sweep_lengths(given: Option<&[usize]>, cap: usize) -> Vec<usize> {
    match given {
        Some(seqs) => seqs.to_vec(),
        None => std::iter::successors(Some(1024), |s| Some(s * 2))
            .take_while(|&s| s <= cap)
            .collect(),
    }
}

/// Runs every (model, batch, sequence, implementation) of `args` in child
/// processes; an implementation that fails at one length (out of memory,
/// time limit) is not tried at longer ones.
pub fn sweep(args: &Args, models: &[String], report: &mut Report) {
    let impls = if args.implementation.is_empty() {
        TrainImpl::value_variants().to_vec()
    } else {
        args.implementation.clone()
    };
    let exe = std::env::current_exe().expect("the benchmark's own path");
    let dtype = args.dtype_name();
    for model in models {
        let context = match presets::preset(model) {
            Ok(c) => c.max_position_embeddings,
            Err(e) => {
                report.notes.push(format!("{model}: {e}"));
                continue;
            }
        };
        let default_seqs = if args.tiny {
            Some(&[64, 256][..])
        } else {
            None
        };
        let seqs = sweep_lengths(
            args.seq.as_deref().or(default_seqs),
            context.min(args.max_seq),
        );
        for &batch in args.batches() {
            let mut failed: Vec<(TrainImpl, DataLayout, usize)> = Vec::new();
            for &seq in &seqs {
                for (&imp, &layout, &devices) in impls.iter().flat_map(|i| {
                    args.layout
                        .iter()
                        .flat_map(move |l| args.devices.iter().map(move |d| (i, l, d)))
                }) {
                    if failed.contains(&(imp, layout, devices)) {
                        continue;
                    }
                    let mut name = imp.name().to_string();
                    if args.attention != crate::AttentionArg::Auto && imp != TrainImpl::Burn {
                        name = format!("{name}, {} attention", attention_name(args));
                    }
                    if layout != DataLayout::Full {
                        name = format!("{name}, {}", layout.name());
                    }
                    if let Some(rank) = args.lora {
                        name = format!("{name}, LoRA r{rank}");
                    }
                    if let Some(every) = args.checkpointing {
                        name = format!("{name}, checkpointing {}", Checkpointing::Every(every));
                    }
                    if let Some(experts) = args.experts {
                        name = format!("{name}, {} experts", experts.name());
                    }
                    if args.loss_weight_grad_sum.sum() != WeightGradSum::default()
                        && imp != TrainImpl::Burn
                    {
                        name = format!(
                            "{name}, loss weight gradient {}",
                            args.loss_weight_grad_sum.name()
                        );
                    }
                    if let Some(backend) = args.runtime.and_then(|rt| cuda_backend(rt, model, imp))
                    {
                        name = format!("{name}, {}", backend.name());
                    }
                    if devices > 1 {
                        name = format!("{name}, {devices} GPUs");
                    }
                    if args.step_graphs && imp != TrainImpl::Burn {
                        name = format!("{name}, step graphs");
                    }
                    let task = format!("train {model} batch {batch} seq {seq} {dtype}: {name}");
                    progress::task(&task);
                    let config = Config {
                        model,
                        batch,
                        seq,
                        imp,
                        layout,
                        devices,
                    };
                    let mut row = if args.no_cold_start {
                        child(&exe, args, &task, &config, None)
                    } else {
                        cold_then_warm(&exe, args, &task, &config)
                    };
                    row.implementation = name;
                    match (&row.ms_per_step, &row.error) {
                        (Some(ms), _) => progress::log(format!(
                            "   {ms:.1} ms/step, {:.0} tokens/s, {:.0} MiB reserved",
                            row.tokens_per_s.unwrap_or(f64::NAN),
                            row.peak_mib.unwrap_or(f64::NAN)
                        )),
                        (None, Some(e)) => {
                            progress::log(format!("   failed: {e}"));
                            failed.push((imp, layout, devices));
                        }
                        (None, None) => {}
                    }
                    progress::done();
                    report.train.push(row);
                }
            }
        }
    }
}

/// The backend a Bastile row of `model` trains on under `runtime`: with
/// `--runtime cuda` the one `bastile finetune` picks (`CudaDirect` for a
/// dense model, on one GPU or several; Burn's `Cuda` for a model with
/// experts); `None` for Burn's rows and off CUDA.
pub fn cuda_backend(runtime: crate::Runtime, model: &str, imp: TrainImpl) -> Option<CudaBackend> {
    use crate::Runtime;
    if imp == TrainImpl::Burn {
        return None;
    }
    match runtime {
        Runtime::Cuda => Some(CudaBackend::for_bastile(model_routes_experts(model))),
        Runtime::CudaFusion => Some(CudaBackend::Fusion),
        Runtime::CudaDirect => Some(CudaBackend::Direct),
        Runtime::Wgpu => None,
    }
}

/// One training configuration of a sweep.
struct Config<'a> {
    model: &'a str,
    batch: usize,
    seq: usize,
    imp: TrainImpl,
    layout: DataLayout,
    devices: usize,
}

/// Runs `config` first in a process whose caches are empty, up to the end
/// of its first step (the start a fresh machine sees), then measures it in
/// a second process on the caches the first one left (the start of every
/// later run), and deletes them.
fn cold_then_warm(exe: &Path, args: &Args, task: &str, config: &Config) -> TrainRow {
    let caches = std::env::temp_dir().join(format!(
        "bastile-bench-caches-{}-{}",
        std::process::id(),
        COLD_RUNS.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&caches);
    if let Err(e) = std::fs::create_dir_all(&caches) {
        progress::log(format!(
            "   no cold start: cannot create {}: {e}",
            caches.display()
        ));
        return child(exe, args, task, config, None);
    }
    // The children run in `caches`: CubeCL's configuration of this
    // directory (a `cubecl.toml`, e.g. its logging) goes with them.
    if let Ok(config) = std::fs::read("cubecl.toml") {
        let _ = std::fs::write(caches.join("cubecl.toml"), config);
    }
    progress::log("   cold start: empty caches, up to the end of step 0");
    let cold = child(exe, args, task, config, Some(Caches::empty(&caches)));
    if let Some(e) = &cold.error {
        progress::log(format!("   cold start failed: {e}"));
    }
    let mut row = child(exe, args, task, config, Some(Caches::kept(&caches)));
    row.cold_start_s = cold.start_s;
    let _ = std::fs::remove_dir_all(&caches);
    row
}

/// Cold-start runs so far in this process (each gets its own caches).
static COLD_RUNS: AtomicUsize = AtomicUsize::new(0);

/// Where a child keeps its caches, instead of the machine's.
struct Caches<'a> {
    dir: &'a Path,
    /// Stop after the first step: the cold run measures only the start.
    first_step_only: bool,
}

impl<'a> Caches<'a> {
    fn empty(dir: &'a Path) -> Self {
        Caches {
            dir,
            first_step_only: true,
        }
    }

    fn kept(dir: &'a Path) -> Self {
        Caches {
            dir,
            first_step_only: false,
        }
    }

    /// Points every cache a run fills into `dir`: Bastile's compiled
    /// kernels, the CUDA driver's compiled code, and CubeCL's autotune
    /// results (kept under the working directory's Cargo project, else
    /// under `XDG_CACHE_HOME`, so the child runs in `dir`).
    fn apply(&self, cmd: &mut Command) {
        cmd.current_dir(self.dir)
            .env(
                bastile::kernel_cache::KERNEL_CACHE_VAR,
                self.dir.join("kernels"),
            )
            .env("CUDA_CACHE_PATH", self.dir.join("cuda"))
            .env("XDG_CACHE_HOME", self.dir.join("xdg"));
        if self.first_step_only {
            cmd.arg("--first-step-only");
        }
    }
}

/// Runs one configuration in a child process and reads its row; a child
/// that dies or runs past `--child-timeout` becomes a failed row saying why.
fn child(exe: &Path, args: &Args, task: &str, config: &Config, caches: Option<Caches>) -> TrainRow {
    let &Config {
        model,
        batch,
        seq,
        imp,
        layout,
        devices,
    } = config;
    let failed = |error: String| TrainRow {
        error: Some(error),
        ..TrainRow::unmeasured(model, (batch, seq), args.dtype_name(), imp, devices)
    };
    let runtime = args
        .runtime
        .expect("a measuring run has a runtime")
        .to_possible_value()
        .expect("runtime names")
        .get_name()
        .to_string();
    let imp_name = imp.to_possible_value().expect("impl names");
    let lora: Vec<String> = args
        .lora
        .map(|r| vec!["--lora".into(), r.to_string()])
        .unwrap_or_default();
    let checkpointing: Vec<String> = args
        .checkpointing
        .map(|n| vec!["--checkpointing".into(), n.to_string()])
        .unwrap_or_default();
    let mut cmd = Command::new(exe);
    if let Some(caches) = &caches {
        caches.apply(&mut cmd);
    }
    let spawned = cmd
        .args(["--runtime", &runtime, "--model", model, "--impl"])
        .arg(imp_name.get_name())
        .args(["--batch", &batch.to_string(), "--seq", &seq.to_string()])
        .args(["--steps", &args.steps.to_string(), "--child"])
        .args(["--attention", attention_name(args)])
        .args(["--dtype", args.dtype_name()])
        .args(["--layout", layout.name()])
        .args(["--devices", &devices.to_string()])
        .args(&lora)
        .args(&checkpointing)
        .args(args.experts.iter().flat_map(|e| ["--experts", e.name()]))
        .args(["--loss-weight-grad-sum", args.loss_weight_grad_sum.name()])
        .args(args.step_graphs.then_some("--step-graphs"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut proc = match spawned {
        Ok(p) => p,
        Err(e) => return failed(format!("could not start {}: {e}", exe.display())),
    };
    // The child's progress is shown as it comes; its last lines explain a
    // failure.
    let stderr = proc.stderr.take().expect("piped");
    let task = task.to_string();
    let echo = std::thread::spawn(move || {
        let mut tail = Vec::new();
        let mut oom = None;
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            progress::child_line(&task, &line);
            // The first panic names the cause; the panics it sets off on
            // other threads fill the tail.
            if oom.is_none() {
                oom = out_of_memory(&line);
            }
            tail.push(line);
            if tail.len() > 8 {
                tail.remove(0);
            }
        }
        (tail, oom)
    });
    let stdout = proc.stdout.take().expect("piped");
    let rows = std::thread::spawn(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .find_map(|l| l.strip_prefix(ROW_TAG).map(str::to_owned))
    });
    let deadline = Instant::now() + Duration::from_secs(args.child_timeout);
    let status = loop {
        match proc.try_wait() {
            Ok(Some(status)) => break Ok(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
            Ok(None) => {
                // Killing closes the pipes, which ends both readers.
                let _ = proc.kill();
                let _ = proc.wait();
                break Err(format!(
                    "timed out after {} s (--child-timeout)",
                    args.child_timeout
                ));
            }
            Err(e) => break Err(format!("lost the child process: {e}")),
        }
    };
    let row = rows.join().unwrap_or_default();
    let (tail, oom) = echo.join().unwrap_or_default();
    let status = match status {
        Ok(status) => status,
        Err(why) => return failed(why),
    };
    match row.map(|r| serde_json::from_str::<TrainRow>(&r)) {
        Some(Ok(row)) => row,
        Some(Err(e)) => failed(format!("unreadable result: {e}")),
        None => failed(if let Some(oom) = oom {
            oom
        } else {
            let first = tail
                .iter()
                .find(|l| l.contains("panicked") || l.contains("error"));
            let why = first.or(tail.last()).map_or("", String::as_str);
            format!("exited with {status}: {why}")
        }),
    }
}

/// A failure as a table cell or a legend says it; the whole message is in
/// the JSON.
pub fn failure_label(error: &str) -> &'static str {
    if error.contains("out of memory") {
        "out of memory"
    } else if error.contains("timed out") {
        "timed out"
    } else {
        "failed"
    }
}

/// What a line of a child's stderr says of a failed device allocation:
/// with its size where CubeCL names it ("can't allocate buffer of size"),
/// `None` when it reports none.
fn out_of_memory(line: &str) -> Option<String> {
    if let Some(bytes) = allocation_failure(line) {
        return Some(out_of_memory_message(bytes));
    }
    ["out of memory", "OutOfMemory", "can't allocate buffer"]
        .iter()
        .any(|m| line.contains(m))
        .then(|| "out of memory".into())
}

fn attention_name(args: &Args) -> &'static str {
    match args.attention {
        crate::AttentionArg::Auto => "auto",
        crate::AttentionArg::TensorCores => "tensor-cores",
        crate::AttentionArg::Tiled => "tiled",
        crate::AttentionArg::Products => "products",
    }
}

/// In the child: measures one configuration on one device and prints its
/// row.
pub fn run_child<R, B>(device: &B::Device, args: &Args, imp: TrainImpl)
where
    R: cubecl::Runtime<Device = B::Device>,
    B: bastile::ops::KernelBackend + BastileBackend,
{
    if args.devices.first().is_some_and(|&d| d > 1) {
        report_row(Err(
            "--devices above 1 needs CUDA and a build with feature `distributed`".into(),
        ));
    }
    let run = Run::from_args(args, imp);
    let row = match imp {
        TrainImpl::Burn => measure::<R, Autodiff<B>>(device, &run, None),
        TrainImpl::BastileKernels | TrainImpl::Bastile => {
            run.apply_patches();
            measure::<R, Autodiff<Bastile<B>>>(device, &run, None)
        }
    };
    report_row(row)
}

/// In the child: measures one configuration data-parallel over the first
/// `--devices` GPUs, gradients summed through NCCL: during the backward
/// pass when `during_backward` (a backend that launches each operation
/// when it is called, see [`bastile_models::Collective::during_backward`]),
/// else after it.
#[cfg(feature = "distributed")]
pub fn run_child_parallel<R, B>(args: &Args, imp: TrainImpl, during_backward: bool) -> !
where
    R: cubecl::Runtime<Device = B::Device>,
    B: bastile::ops::KernelBackend
        + BastileBackend
        + burn::tensor::backend::distributed::DistributedBackend,
{
    use bastile_models::{Collective, DataParallelOptions};
    use burn::tensor::backend::{Device, DeviceId};
    let count = args.devices[0];
    let devices: Vec<B::Device> = (0..count)
        .map(|k| B::Device::from_id(DeviceId::new(0, k as u16)))
        .collect();
    let run = Run::from_args(args, imp);
    let options = DataParallelOptions {
        wait: Duration::from_secs(args.child_timeout),
    };
    fn collective<X: burn::tensor::backend::distributed::DistributedBackend>(
        devices: &[X::Device],
        during_backward: bool,
    ) -> Result<Collective<X>, String> {
        let c = Collective::nccl(devices).map_err(|e| e.to_string())?;
        Ok(if during_backward {
            c.during_backward()
        } else {
            c
        })
    }
    let row = match imp {
        TrainImpl::Burn => collective::<B>(&devices, during_backward).and_then(|c| {
            measure::<R, Autodiff<B>>(&devices[0], &run, Some((devices.clone(), c, options)))
        }),
        TrainImpl::BastileKernels | TrainImpl::Bastile => {
            run.apply_patches();
            collective::<Bastile<B>>(&devices, during_backward).and_then(|c| {
                measure::<R, Autodiff<Bastile<B>>>(
                    &devices[0],
                    &run,
                    Some((devices.clone(), c, options)),
                )
            })
        }
    };
    report_row(row)
}

/// Prints the child's row (or its error, exiting with 1).
fn report_row(row: Result<TrainRow, String>) -> ! {
    let row = row.unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(1)
    });
    println!(
        "{ROW_TAG}{}",
        serde_json::to_string(&row).expect("rows serialize")
    );
    std::process::exit(0)
}

impl<'a> Run<'a> {
    fn from_args(args: &'a Args, imp: TrainImpl) -> Self {
        let model = args.model.first().expect("--model");
        let (batch, seq) = (args.batches()[0], args.seq.as_ref().expect("--seq")[0]);
        Run {
            model,
            imp,
            batch,
            seq,
            dtype: args.dtype(),
            steps: args.steps,
            layout: args.layout.first().copied().unwrap_or(DataLayout::Full),
            lora: args.lora,
            checkpointing: args
                .checkpointing
                .map_or(Checkpointing::Off, Checkpointing::Every),
            expert_routing: args.experts.map(bastile_cli::ExpertsArg::routing),
            loss_weight_grad_sum: args.loss_weight_grad_sum.sum(),
            first_step_only: args.first_step_only,
            step_graphs: args.step_graphs && imp != TrainImpl::Burn,
            precompile: imp != TrainImpl::Burn && args.runtime.is_some_and(crate::Runtime::is_cuda),
        }
    }

    /// Bastile's patches for this implementation (every op; the matmul
    /// only for [`TrainImpl::Bastile`]).
    fn apply_patches(&self) {
        bastile::apply(Patches {
            matmul: self.imp == TrainImpl::Bastile,
            ..Patches::default()
        });
    }
}

/// One configuration a child measures.
struct Run<'a> {
    model: &'a str,
    imp: TrainImpl,
    batch: usize,
    seq: usize,
    dtype: DType,
    steps: usize,
    layout: DataLayout,
    /// LoRA rank: adapters on every projection of the frozen model.
    lora: Option<usize>,
    checkpointing: Checkpointing,
    /// `None`: the model's own.
    expert_routing: Option<ExpertRouting>,
    /// How Bastile's fused loss sums the output layer's gradient.
    loss_weight_grad_sum: WeightGradSum,
    /// Stop after step 0 and report only the start.
    first_step_only: bool,
    /// Record a step as CUDA graphs and time its replays.
    step_graphs: bool,
    /// Compile the step's kernels in worker processes on a fresh machine
    /// (Bastile's kernels on CUDA, where the kernel cache lets the
    /// measuring process load what they compiled).
    precompile: bool,
}

/// Data-parallel training: every worker's device (the first is the
/// measuring one), their collective and the wait for a worker.
type Parallel<A> = (
    Vec<<A as burn::tensor::backend::BackendTypes>::Device>,
    bastile_models::Collective<<A as AutodiffBackend>::InnerBackend>,
    bastile_models::DataParallelOptions,
);

fn measure<R, A>(
    device: &A::Device,
    run: &Run,
    parallel: Option<Parallel<A>>,
) -> Result<TrainRow, String>
where
    R: cubecl::Runtime<Device = A::Device>,
    A: AutodiffBackend + BastileBackend,
    A::InnerBackend: BastileBackend,
    bastile_models::CausalLm<A>: Send + 'static,
    MicroBatch<A>: Send,
{
    let &Run {
        model,
        imp,
        batch,
        seq,
        dtype,
        steps,
        layout,
        lora,
        checkpointing,
        expert_routing,
        loss_weight_grad_sum,
        first_step_only,
        step_graphs,
        ..
    } = run;
    let config = presets::preset(model).map_err(|e| e.to_string())?;
    let started = Instant::now();
    let build = |config: &HfConfig| {
        CausalLm::<A>::init(config, device)
            .and_then(|m| m.with_dtype(dtype))
            .and_then(|m| match lora {
                Some(rank) => {
                    m.with_lora(LoraConfig::new(rank).with_alpha(2.0 * rank as f64), device)
                }
                None => Ok(m),
            })
            .and_then(|m| m.with_checkpointing(checkpointing))
            .and_then(|m| match expert_routing {
                Some(routing) => m.with_expert_routing(routing),
                None => Ok(m),
            })
            .map_err(|e| e.to_string())
    };
    let train = TrainConfig {
        learning_rate: 1e-5,
        loss_weight_grad_sum,
        ..TrainConfig::default()
    };
    let vocab = config.vocab_size;
    if let Some(part) = precompile::worker_part().map_err(|e| e.to_string())? {
        let batch = match layout {
            DataLayout::Full => precompile::plain_batch(batch, seq, device),
            _ => {
                let (first, _) = micro_batches(layout, batch, seq, vocab, 1, device).swap_remove(0);
                precompile::worker_batch(&first)
            }
        };
        let build = |c: &HfConfig| build(c).map_err(bastile_models::ModelError::Config);
        precompile::run_part(part, &config, dtype, build, batch, train)
            .map_err(|e| e.to_string())?;
        std::process::exit(0);
    }
    // A fresh machine compiles the step's kernels in worker processes
    // beside this one (one device only: data-parallel runs start theirs
    // on every device).
    let mut workers_started = (run.precompile && parallel.is_none())
        .then(|| {
            let what = format!(
                "{model} {batch}x{seq} {dtype:?} {} {} lora {lora:?} {checkpointing} {expert_routing:?}",
                imp.name(),
                layout.name()
            );
            Precompile::spawn(&Part::ALL, &what)
        })
        .flatten();
    if let Some(w) = &workers_started {
        let parts: Vec<&str> = w.parts().iter().map(|p| p.name()).collect();
        eprintln!("compiling kernels in workers: {}", parts.join(", "));
    }
    let mut lm = build(&config)?;
    let timed_steps = steps.max(1);
    let devices = parallel
        .as_ref()
        .map_or_else(|| vec![device.clone()], |(devices, ..)| devices.clone());
    let workers = devices.len();
    if workers > 1 && layout != DataLayout::Full {
        return Err("data-parallel runs train on random tokens (--layout full)".into());
    }
    // Each step's micro-batches (one per worker) and their trained tokens.
    let data: Vec<(Vec<MicroBatch<A>>, usize)> = if layout == DataLayout::Full {
        // Each worker's micro-batch on its own device.
        let full = devices
            .iter()
            .map(|device| random_batch::<A>(batch, seq, vocab, false, device))
            .collect();
        vec![(full, workers * batch * seq)]
    } else {
        micro_batches(layout, batch, seq, vocab, timed_steps, device)
            .into_iter()
            .map(|(m, tokens)| (vec![m], tokens))
            .collect()
    };
    let timed: Vec<usize> = (0..timed_steps).map(|i| i % data.len()).collect();
    // Warm-up: two steps, and one of every other shape the timed steps
    // meet (each new shape compiles and tunes kernels, a cost a long run
    // pays once).
    let shape = |i: usize| data[i].0[0].ids.dims();
    let mut warmup = vec![timed[0], timed[0]];
    if step_graphs {
        // The third step of a shape is recorded and the fourth is its
        // first replay: both are warm-up.
        warmup.extend([timed[0], timed[0]]);
    }
    for &i in &timed {
        if !warmup.iter().any(|&w| shape(w) == shape(i)) {
            warmup.push(i);
        }
    }
    let mut trainer = Trainer::<A>::new(train).map_err(|e| e.to_string())?;
    if step_graphs {
        trainer = trainer.with_step_graphs().map_err(|e| e.to_string())?;
    }
    if let Some((devices, collective, options)) = parallel {
        trainer = trainer
            .data_parallel(&lm, &devices, collective, options)
            .map_err(|e| e.to_string())?;
    }
    // Kernel compilation and autotuning happen in the warm-up steps.
    // Every step ends with its loss read back, i.e. a device sync.
    let mut times = Vec::new();
    let mut host = Vec::new();
    let mut tokens = 0;
    let mut first_step = 0.0;
    let mut start = 0.0;
    let steps = warmup
        .iter()
        .map(|&i| (i, true))
        .chain(timed.iter().map(|&i| (i, false)));
    for (n, (i, warm)) in steps.enumerate() {
        let t = Instant::now();
        let (next, out) = trainer.step(lm, &data[i].0);
        lm = next;
        let out = out.map_err(|e| e.to_string())?;
        let secs = t.elapsed().as_secs_f64();
        eprintln!(
            "step {n}: {:?}, loss {:.4}, {:.1} ms (host {:.1} ms){}",
            shape(i),
            out.loss,
            secs * 1e3,
            out.host_seconds * 1e3,
            if warm { " (warm-up)" } else { "" }
        );
        if n == 0 {
            first_step = secs;
            start = crate::PROCESS_START.elapsed().as_secs_f64();
            if let Some(w) = workers_started.take() {
                let report = w.finish();
                eprintln!(
                    "kernel workers: {} done, {} stopped, {} failed {:?}",
                    report.done.len(),
                    report.stopped.len(),
                    report.failed.len(),
                    report.failed
                );
            }
            if first_step_only {
                eprintln!("step 0 ended {start:.1} s after the process started");
                return Ok(TrainRow {
                    first_step_s: Some(first_step),
                    start_s: Some(start),
                    ..TrainRow::unmeasured(
                        model,
                        (batch, seq),
                        crate::dtype_name(dtype),
                        imp,
                        workers,
                    )
                });
            }
        }
        if !warm {
            times.push(secs);
            host.push(out.host_seconds);
            tokens += data[i].1;
        }
    }
    let total: f64 = times.iter().sum();
    let range = times
        .iter()
        .fold((f64::INFINITY, 0f64), |(lo, hi), &t| (lo.min(t), hi.max(t)));
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let secs = median(times);
    let client = R::client(device);
    let mut reserved = client
        .memory_usage()
        .map_err(|e| format!("{e:?}"))?
        .bytes_reserved;
    if step_graphs {
        let Some(kernels) = trainer.replaying() else {
            return Err("--step-graphs: the step was not recorded (see the log)".into());
        };
        eprintln!("the timed steps replayed a recorded step of {kernels} kernels");
        // The steps' memory is in the pool of the trainer's own stream.
        let stream = trainer.graph_stream().expect("step graphs");
        let usage = stream
            .run(|| client.memory_usage())
            .map_err(|e| format!("{e:?}"))?;
        reserved += usage.bytes_reserved;
    }
    // The largest micro-batch of the run.
    let largest = (0..data.len())
        .max_by_key(|&i| shape(i).iter().product::<usize>())
        .expect("at least one micro-batch");
    // One more step, untimed, while the bytes in use are sampled. A replay
    // works in memory its pool counts as free: its bytes in use are not
    // measured.
    let ((lm, out), in_use) = peak_in_use::<R, _>(&client, || trainer.step(lm, &data[largest].0))?;
    out.map_err(|e| e.to_string())?;
    let in_use = (!step_graphs).then_some(in_use);
    let memory = if workers == 1 && checkpointing == Checkpointing::Off && !step_graphs {
        Some(memory_breakdown::<R, A>(
            &client,
            device,
            (&lm, dtype),
            &data[largest].0[0],
        )?)
    } else {
        None
    };
    eprintln!("done in {:.0} s", started.elapsed().as_secs_f64());
    Ok(TrainRow {
        model: model.into(),
        batch,
        seq,
        dtype: crate::dtype_name(dtype).into(),
        implementation: imp.name().into(),
        ms_per_step: Some(secs * 1e3),
        ms_range: Some((range.0 * 1e3, range.1 * 1e3)),
        // Full rows: the median step's; a data set's steps differ in size,
        // so its trained (non-padding) tokens over the timed steps' time.
        tokens_per_s: Some(match layout {
            DataLayout::Full => (workers * batch * seq) as f64 / secs,
            _ => tokens as f64 / total,
        }),
        peak_mib: Some(reserved as f64 / MIB),
        in_use_mib: in_use.map(|b| b as f64 / MIB),
        first_step_s: Some(first_step),
        start_s: Some(start),
        cold_start_s: None,
        host_ms: Some(median(host) * 1e3),
        error: None,
        devices: workers,
        memory,
    })
}

/// Runs `f` while another thread reads the bytes in use back to back
/// (CubeCL keeps no peak of its own); `f`'s result and the largest read.
/// Each read queues on CubeCL's device thread between `f`'s operations,
/// and allocations follow the order the host issues them in, so a
/// buffer that lives across a few operations is seen however fast the
/// GPU runs (one that lives within a single operation may still be
/// missed: the result is a lower bound). CubeCL keeps a memory pool per
/// stream, and a thread's stream is its own: the sampler reads the
/// calling thread's.
fn peak_in_use<R: cubecl::Runtime, T>(
    client: &cubecl::client::ComputeClient<R>,
    f: impl FnOnce() -> T,
) -> Result<(T, u64), String> {
    let stop = Arc::new(AtomicBool::new(false));
    let stream = cubecl::stream_id::StreamId::current();
    let sampler = {
        let (stop, client) = (stop.clone(), client.clone());
        std::thread::spawn(move || {
            let mut peak = 0u64;
            while !stop.load(Ordering::Relaxed) {
                if let Ok(u) = stream.executes(|| client.memory_usage()) {
                    peak = peak.max(u.bytes_in_use);
                }
            }
            peak
        })
    };
    let out = f();
    stop.store(true, Ordering::Relaxed);
    let peak = sampler.join().map_err(|_| "the memory sampler panicked")?;
    Ok((out, peak))
}

/// [`MemoryBreakdown`] of one forward and backward pass over `batch`
/// (the training step's loss, without the optimizer).
fn memory_breakdown<R, A>(
    client: &cubecl::client::ComputeClient<R>,
    device: &A::Device,
    (lm, dtype): (&CausalLm<A>, DType),
    batch: &MicroBatch<A>,
) -> Result<MemoryBreakdown, String>
where
    R: cubecl::Runtime<Device = A::Device>,
    A: AutodiffBackend + BastileBackend,
{
    use burn::module::Module;
    let in_use = || -> Result<f64, String> {
        A::sync(device).map_err(|e| format!("{e:?}"))?;
        let usage = client.memory_usage().map_err(|e| format!("{e:?}"))?;
        Ok(usage.bytes_in_use as f64 / MIB)
    };
    let parameters_mib = (lm.num_params() * dtype.size()) as f64 / MIB;
    let between_steps = in_use()?;
    let options = bastile::CrossEntropyOptions::default();
    let pass = || -> Result<(f64, f64), String> {
        let loss = lm
            .loss_of(
                batch.ids.clone(),
                batch.labels.clone(),
                batch.positions.clone(),
                options,
            )
            .map_err(|e| e.to_string())?
            .loss;
        let after_forward = in_use()?;
        let grads = loss.backward();
        let after_backward = in_use()?;
        drop(grads);
        Ok((after_forward, after_backward))
    };
    let (phases, peak) = peak_in_use::<R, _>(client, pass)?;
    let (after_forward, after_backward) = phases?;
    Ok(MemoryBreakdown {
        parameters_mib,
        optimizer_state_mib: between_steps - parameters_mib,
        forward_kept_mib: after_forward - between_steps,
        gradients_mib: after_backward - between_steps,
        pass_peak_mib: peak as f64 / MIB - between_steps,
    })
}

#[cfg(test)]
mod tests {
    use super::{CudaBackend, TrainImpl, cuda_backend, sweep_lengths};
    use crate::Runtime;

    #[test]
    fn bastile_rows_train_on_the_backend_the_command_picks() {
        let (direct, fusion) = (Some(CudaBackend::Direct), Some(CudaBackend::Fusion));
        let (bastile, kernels) = (TrainImpl::Bastile, TrainImpl::BastileKernels);
        // `--runtime cuda`: dense models without the stream (on one GPU or
        // several), experts over it, as `bastile finetune` runs them.
        assert_eq!(cuda_backend(Runtime::Cuda, "qwen3-0.6b", bastile), direct);
        assert_eq!(cuda_backend(Runtime::Cuda, "llama-3.2-1b", kernels), direct);
        assert_eq!(
            cuda_backend(Runtime::Cuda, "gpt-oss-20b-4l", bastile),
            fusion
        );
        // The other runtimes force theirs; Burn's rows name none.
        assert_eq!(
            cuda_backend(Runtime::CudaFusion, "qwen3-0.6b", bastile),
            fusion
        );
        assert_eq!(
            cuda_backend(Runtime::CudaDirect, "gpt-oss-20b-4l", bastile),
            direct
        );
        assert_eq!(
            cuda_backend(Runtime::Cuda, "qwen3-0.6b", TrainImpl::Burn),
            None
        );
        assert_eq!(cuda_backend(Runtime::Wgpu, "qwen3-0.6b", bastile), None);
    }

    #[test]
    fn the_default_sweep_doubles_from_1024_up_to_the_cap() {
        assert_eq!(
            sweep_lengths(None, 40960),
            [1024, 2048, 4096, 8192, 16384, 32768]
        );
        assert_eq!(sweep_lengths(None, 2048), [1024, 2048]);
        assert_eq!(sweep_lengths(None, 1000), Vec::<usize>::new());
        assert_eq!(sweep_lengths(Some(&[512, 64]), 100), [512, 64]);
    }

    #[test]
    fn a_cold_start_keeps_every_cache_in_its_own_directory() {
        use std::ffi::OsStr;
        use std::path::Path;
        let dir = Path::new("/tmp/caches-7");
        let env = |cmd: &super::Command, name: &str| {
            cmd.get_envs()
                .find(|(k, _)| *k == OsStr::new(name))
                .and_then(|(_, v)| v.map(Path::new))
                .map(Path::to_path_buf)
        };
        for (caches, cold) in [
            (super::Caches::empty(dir), true),
            (super::Caches::kept(dir), false),
        ] {
            let mut cmd = super::Command::new("bench");
            caches.apply(&mut cmd);
            assert_eq!(cmd.get_current_dir(), Some(dir));
            assert_eq!(
                env(&cmd, bastile::kernel_cache::KERNEL_CACHE_VAR),
                Some(dir.join("kernels"))
            );
            assert_eq!(env(&cmd, "CUDA_CACHE_PATH"), Some(dir.join("cuda")));
            assert_eq!(env(&cmd, "XDG_CACHE_HOME"), Some(dir.join("xdg")));
            let first_step_only = cmd.get_args().any(|a| a == "--first-step-only");
            assert_eq!(first_step_only, cold);
        }
    }

    #[test]
    fn cubecl_allocation_failures_read_as_out_of_memory() {
        let oom = super::out_of_memory(
            "called `Result::unwrap()` on an `Err` value: can't allocate buffer of size: 5313593344",
        )
        .unwrap();
        assert_eq!(
            oom,
            "out of memory on the device: an allocation of 5313593344 bytes (4.95 GiB) failed"
        );
        assert_eq!(super::failure_label(&oom), "out of memory");
        assert_eq!(
            super::out_of_memory("CUDA error: out of memory").as_deref(),
            Some("out of memory")
        );
        assert_eq!(
            super::out_of_memory("called `Result::unwrap()` on an `Err` value: CallError"),
            None
        );
    }
}
