//! `bastile-bench`: Bastile's fused kernels against Burn's composite ops on
//! one device, in one process, with the device's measured copy bandwidth as
//! the yardstick; end-to-end training steps against Burn, each
//! configuration in a process of its own; optionally the same work through
//! PyTorch. Results are printed as Markdown and written as JSON, Markdown
//! and PNG charts. `cargo xtask bench` builds and runs it.

mod adamw;
mod attention;
mod chart;
mod copy;
mod geglu;
mod linear_cross_entropy;
mod matmul;
mod moe;
mod packing;
mod passes;
mod progress;
mod pytorch;
mod replot;
mod report;
mod rms_norm;
mod rope;
mod swiglu;
mod timing;
mod train;

use std::sync::LazyLock;
use std::time::Instant;

use burn::tensor::DType;
use clap::{Parser, ValueEnum};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Runtime {
    /// CUDA on the backends `bastile finetune` trains on: Bastile's rows
    /// of a dense model over `bastile::CudaDirect` (on one GPU or
    /// several), those of a model with experts over `burn::backend::Cuda`
    /// (Burn's fusion stream), Burn's rows over `burn::backend::Cuda`.
    /// Each Bastile row names its backend.
    Cuda,
    /// CUDA, every row over `burn::backend::Cuda` (Burn's fusion stream).
    CudaFusion,
    /// CUDA, every row over `bastile::CudaDirect` (Burn's `CubeBackend`
    /// without the fusion stream): every op is dispatched as it comes,
    /// and Burn's own element-wise ops are not fused.
    #[value(alias = "cuda-unfused")]
    CudaDirect,
    Wgpu,
}

impl Runtime {
    pub fn is_cuda(self) -> bool {
        self != Runtime::Wgpu
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OpName {
    Adamw,
    RmsNorm,
    Swiglu,
    Geglu,
    Rope,
    /// The fused linear cross-entropy (`flce` is accepted too).
    #[value(alias = "flce")]
    LinearCrossEntropy,
    Matmul,
    /// GPT-OSS's mixture-of-experts layer, routed against its grouped
    /// products (and dense).
    Moe,
    Attention,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum AttentionArg {
    Auto,
    /// Bastile's own tensor-core kernels, never cuDNN's.
    TensorCores,
    Tiled,
    Products,
}

impl AttentionArg {
    /// Makes this choice the process's attention kernels.
    pub fn apply(self) {
        bastile::set_attention_kernels(match self {
            Self::Auto => bastile::AttentionKernels::Auto,
            Self::TensorCores => bastile::AttentionKernels::TensorCores,
            Self::Tiled => bastile::AttentionKernels::Tiled,
            Self::Products => bastile::AttentionKernels::MatrixProducts { block_rows: 0 },
        });
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DtypeArg {
    Bf16,
    F16,
    F32,
}

/// How a dtype is written in the results.
pub fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::F32 => "f32",
        _ => "other",
    }
}

#[derive(Parser, Debug)]
#[command(
    about = "Benchmarks Bastile's fused kernels against Burn's composite ops, and training steps against Burn (and PyTorch)",
    long_about = "Benchmarks Bastile's fused kernels against Burn's composite ops, and training steps against Burn (and, with --compare-pytorch, HF transformers, HF + Liger-Kernel and HF under torch.compile).\n\nWithout --op or --model it runs the default suite: every kernel, then training of the default models over sequence lengths 1024, 2048, ... until every implementation is out of memory, at batch 1 and 4. With --tiny (the software Vulkan device) the suite uses small shapes and the tiny model preset."
)]
pub struct Args {
    /// Which op to benchmark (all when neither this nor `--model` is
    /// given).
    #[arg(long, value_enum)]
    pub op: Option<OpName>,
    /// The runtime to run on (not needed with `--replot`).
    #[arg(long, value_enum, required_unless_present = "replot")]
    pub runtime: Option<Runtime>,
    /// Use the small shapes meant for the software Vulkan driver.
    #[arg(long)]
    pub tiny: bool,
    /// Write the results as JSON, with Markdown (`.md`) and PNG charts
    /// (`-<name>.png`) beside it.
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
    /// With `--op linear-cross-entropy`: run only this configuration (index into the list
    /// the run prints), so each can be measured in a fresh process whose
    /// memory pool holds nothing else.
    #[arg(long)]
    pub case: Option<usize>,
    /// Timed repetitions per measurement (the median is reported).
    #[arg(long, default_value_t = 15)]
    pub samples: usize,
    /// With `--op attention`: calls per timed sample, back to back (as in
    /// training, where the host queues the next call while the device runs
    /// this one), spreading each sample's fixed cost (the opening launch,
    /// the closing sync, and what the fusion backend adds per sample) over
    /// them. `attention_torch.py --calls` takes the same number (and the
    /// same default).
    #[arg(long, default_value_t = 10)]
    pub calls: usize,
    /// Train these model presets end to end (random weights, AdamW)
    /// instead of benchmarking kernels, e.g. `qwen3-0.6b,llama-3.2-1b`.
    #[arg(long, value_delimiter = ',')]
    pub model: Vec<String>,
    /// Sequence lengths (training: 1024, 2048, ... doubling until every
    /// implementation is out of memory; attention: 2048 to 16384).
    #[arg(long, value_delimiter = ',')]
    pub seq: Option<Vec<usize>>,
    /// Training: the longest sequence the sweep tries.
    #[arg(long, default_value_t = 65536)]
    pub max_seq: usize,
    /// Training: batch sizes to sweep (default 1 and 4).
    #[arg(long, value_delimiter = ',')]
    pub batch: Option<Vec<usize>>,
    /// Training dtype (default bf16; f32 with `--tiny`).
    #[arg(long, value_enum)]
    pub dtype: Option<DtypeArg>,
    /// Training: only these implementations (all three when omitted);
    /// with `--op attention`: `burn` or `bastile` (both when omitted).
    #[arg(long = "impl", value_enum, value_delimiter = ',')]
    pub implementation: Vec<train::TrainImpl>,
    /// Training: what the steps train on (`full`: random tokens filling
    /// every row; `padded` / `packed`: an instruction data set of mixed
    /// lengths, one example per row or packed into rows of `--seq`
    /// tokens, reported in trained tokens per second).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "full")]
    pub layout: Vec<packing::DataLayout>,
    /// Training: train LoRA adapters of rank R (alpha 2R) on every
    /// linear projection of the frozen model instead of every weight (PEFT
    /// on the PyTorch side).
    #[arg(long, value_name = "R")]
    pub lora: Option<usize>,
    /// Training: how GPT-OSS's experts run in Bastile's models (the
    /// PyTorch rows are HF's own): routed (the model's default), each on
    /// the tokens the router sent it, or dense, every expert on every
    /// token; an error for a model without experts.
    #[arg(long, value_enum, value_name = "HOW")]
    pub experts: Option<bastile_cli::ExpertsArg>,
    /// Training: activation checkpointing, every layer (or every N-th):
    /// each keeps only its input and runs again in the backward pass (HF's
    /// gradient checkpointing on the PyTorch side).
    #[arg(long, value_name = "N", num_args = 0..=1, default_missing_value = "1")]
    pub checkpointing: Option<std::num::NonZeroUsize>,
    /// Training: how Bastile's fused loss sums the output layer's gradient
    /// over its chunks of tokens (`bastile finetune`'s option of the same
    /// name); rows that do not use the default are named so.
    #[arg(long, value_enum, default_value = "chunks", value_name = "HOW")]
    pub loss_weight_grad_sum: bastile_cli::WeightGradSumArg,
    /// Training: GPU counts to train on data-parallel, e.g. `1,2,4`: one
    /// worker per GPU, each with its own micro-batch of `--batch` ×
    /// `--seq`, gradients summed through NCCL (CUDA, a build with feature
    /// `distributed`, `libnccl.so` on the library path).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub devices: Vec<usize>,
    /// Training: Bastile records its third step as CUDA graphs and
    /// replays it for the timed steps (`Trainer::with_step_graphs`): the
    /// host queues a step in a few graph launches. Two more warm-up steps
    /// are taken, so that the timed steps are replays.
    #[arg(long)]
    pub step_graphs: bool,
    /// Training: timed steps (after two warm-up steps).
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// Training: seconds one configuration may take (compilation and
    /// autotuning included) before it is stopped and recorded as timed out.
    #[arg(long, default_value_t = 1800)]
    pub child_timeout: u64,
    /// With `--model` or `--op attention`: which attention kernels
    /// Bastile runs (`auto`: the tensor-core kernels on CUDA in f16/bf16,
    /// else matrix products on cuBLASLt where the matmul patch runs there,
    /// else the tiled kernels).
    #[arg(long, value_enum, default_value = "auto")]
    pub attention: AttentionArg,
    /// Also run the same configurations through PyTorch on this GPU (the
    /// scripts in `benches/python`: HF transformers with its default
    /// attention, HF + Liger-Kernel and HF under torch.compile for
    /// training, SDPA for attention,
    /// cuBLAS for matmul, torch and Liger for the loss); their rows join
    /// the table and charts.
    #[arg(long)]
    pub compare_pytorch: bool,
    /// The Python interpreter for `--compare-pytorch`.
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// Draw the tables and charts again from these results files (this
    /// program's JSON, or the Python scripts' JSON lines) into `--out`,
    /// without measuring anything.
    #[arg(long, num_args = 1.., value_delimiter = ',')]
    pub replot: Vec<std::path::PathBuf>,
    /// Training: leave out the cold start. By default each Bastile and
    /// Burn configuration first runs in a process whose caches are empty
    /// (compiled kernels, the GPU driver's compiled code, autotune
    /// results) until its first step ends, then is measured in a second
    /// process on the caches the first one left; both starts are reported.
    #[arg(long)]
    pub no_cold_start: bool,
    /// Internal: this process measures one training configuration.
    #[arg(long, hide = true)]
    pub child: bool,
    /// Internal: the child stops after its first step (a cold start).
    #[arg(long, hide = true)]
    pub first_step_only: bool,
}

impl Args {
    /// The training dtype.
    pub fn dtype(&self) -> DType {
        match self.dtype {
            Some(DtypeArg::Bf16) => DType::BF16,
            Some(DtypeArg::F16) => DType::F16,
            Some(DtypeArg::F32) => DType::F32,
            None if self.tiny => DType::F32,
            None => DType::BF16,
        }
    }

    pub fn dtype_name(&self) -> &'static str {
        dtype_name(self.dtype())
    }

    /// The training batch sizes.
    pub fn batches(&self) -> &[usize] {
        self.batch.as_deref().unwrap_or(&[1, 4])
    }
}

/// When the process started: starts are measured from it (the model's
/// set-up included).
pub static PROCESS_START: LazyLock<Instant> = LazyLock::new(Instant::now);

fn main() {
    LazyLock::force(&PROCESS_START);
    let args = Args::parse();
    if !args.replot.is_empty() {
        std::process::exit(match replot::run(&args) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("bastile-bench: {e}");
                1
            }
        });
    }
    if !args.child {
        progress::start();
    }
    // Kernels compiled by an earlier run (or configuration) load from disk.
    bastile::kernel_cache::use_kernel_cache();
    let runtime = args
        .runtime
        .expect("clap requires --runtime without --replot");
    let mut report = match runtime {
        Runtime::Cuda | Runtime::CudaFusion | Runtime::CudaDirect => {
            #[cfg(feature = "cuda")]
            {
                run_cuda(&args, runtime)
            }
            #[cfg(not(feature = "cuda"))]
            {
                eprintln!("bastile-bench was built without feature `cuda`");
                std::process::exit(2)
            }
        }
        Runtime::Wgpu => {
            #[cfg(feature = "wgpu")]
            {
                run::<cubecl::wgpu::WgpuRuntime, burn::backend::Wgpu>(&args, "wgpu")
            }
            #[cfg(not(feature = "wgpu"))]
            {
                eprintln!("bastile-bench was built without feature `wgpu`");
                std::process::exit(2)
            }
        }
    };
    if args.compare_pytorch {
        // Bastile's rows are on disk before the PyTorch runs start (the
        // compiled ones take minutes), so a run stopped during them keeps
        // what it measured.
        save(&report, &args, false);
        pytorch::compare(&args, &mut report);
    }
    progress::finish();
    println!("{}", report.markdown());
    save(&report, &args, true);
}

/// Writes the results to `--out`, if given; `last` says where they went.
fn save(report: &report::Report, args: &Args, last: bool) {
    let Some(path) = &args.out else {
        return;
    };
    match report.write(path) {
        Ok(written) if last => {
            for file in written {
                eprintln!("written: {}", file.display());
            }
        }
        Ok(_) => {}
        Err(e) => {
            eprintln!("could not write the results: {e}");
            std::process::exit(1);
        }
    }
}

/// Runs `args` on CUDA over the backend `runtime` names; with `--runtime
/// cuda`, a child measuring a Bastile row picks it as `bastile finetune`
/// does ([`train::cuda_backend`]).
#[cfg(feature = "cuda")]
fn run_cuda(args: &Args, runtime: Runtime) -> report::Report {
    use cubecl::cuda::CudaRuntime;
    let name = runtime
        .to_possible_value()
        .expect("runtime names")
        .get_name()
        .to_string();
    // A child measures one configuration: its model and implementation
    // decide the backend under `--runtime cuda`.
    let child = args.child.then(|| {
        *args
            .implementation
            .first()
            .expect("a child measures one --impl")
    });
    let direct = match (runtime, child) {
        (Runtime::CudaDirect, _) => true,
        (Runtime::Cuda, Some(imp)) => {
            let model = args.model.first().map_or("", String::as_str);
            train::cuda_backend(runtime, model, imp)
                == Some(bastile_cli::device::CudaBackend::Direct)
        }
        _ => false,
    };
    #[cfg(feature = "distributed")]
    if let Some(imp) = child
        && args.devices.first().is_some_and(|&d| d > 1)
    {
        args.attention.apply();
        if direct {
            train::run_child_parallel::<CudaRuntime, bastile::CudaDirect>(args, imp, true);
        }
        train::run_child_parallel::<CudaRuntime, burn::backend::Cuda>(args, imp, false);
    }
    if direct {
        run::<CudaRuntime, bastile::CudaDirect>(args, &name)
    } else {
        run::<CudaRuntime, burn::backend::Cuda>(args, &name)
    }
}

fn run<R, B>(args: &Args, runtime: &str) -> report::Report
where
    R: cubecl::Runtime<Device = B::Device>,
    B: bastile::ops::KernelBackend + bastile::BastileBackend,
{
    let device = B::Device::default();
    args.attention.apply();
    if args.child {
        let imp = *args
            .implementation
            .first()
            .expect("a child measures one --impl");
        train::run_child::<R, B>(&device, args, imp);
        std::process::exit(0)
    }
    // Without `--op` or `--model`: the default suite, kernels and training.
    let kernels = args.op.is_some() || args.model.is_empty();
    let training = !args.model.is_empty() || args.op.is_none();
    // The loss, matmul and attention benchmarks report flops and memory, not
    // bandwidth, and their memory readings must not include the copy
    // test's buffers.
    let copy_gbs = if !kernels
        || matches!(
            args.op,
            Some(OpName::LinearCrossEntropy | OpName::Matmul | OpName::Moe | OpName::Attention)
        ) {
        f64::NAN
    } else {
        copy::measure_copy_bandwidth::<R>(&device, args.tiny, args.samples)
    };
    let mut report = report::Report::new(runtime, &B::name(&device), args.tiny, copy_gbs);
    if training && runtime == "cuda" {
        report.notes.push(
            "The device line is the backend of this process, which runs the kernel benchmarks; \
             each training row ran in a process of its own: Bastile's over the backend its \
             name gives, Burn's over `burn::backend::Cuda`."
                .into(),
        );
    }
    let cuda = R::name(&R::client(&device)) == "cuda";
    if let (true, AttentionArg::Auto, Some(v)) = (cuda, args.attention, bastile::cudnn_version()) {
        report.notes.push(format!(
            "Bastile's attention ran on {}'s fused kernels wherever they take the problem \
             (f16/bf16 without a sliding window, sinks, key lengths or documents); \
             `--attention tensor-cores` runs Bastile's own kernels instead.",
            bastile_cli::device::cudnn_name(v)
        ));
    }
    if kernels {
        progress::log(format!(
            "device copy bandwidth: {copy_gbs:.1} GB/s (read + write)"
        ));
        let wanted = |op| args.op.is_none() || args.op == Some(op);
        type Bench<D> = fn(&D, &Args, &mut report::Report);
        let benches: [(OpName, Bench<B::Device>); 9] = [
            (OpName::Adamw, adamw::bench::<B>),
            (OpName::RmsNorm, rms_norm::bench::<B>),
            (OpName::Swiglu, swiglu::bench::<B>),
            (OpName::Geglu, geglu::bench::<B>),
            (OpName::Rope, rope::bench::<B>),
            (
                OpName::LinearCrossEntropy,
                linear_cross_entropy::bench::<R, B>,
            ),
            (OpName::Matmul, matmul::bench::<B>),
            (OpName::Moe, moe::bench::<B>),
            (OpName::Attention, attention::bench::<R, B>),
        ];
        for (op, bench) in benches.into_iter().filter(|(op, _)| wanted(*op)) {
            let name = op.to_possible_value().expect("op names");
            progress::task(format!("kernels: {}", name.get_name()));
            bench(&device, args, &mut report);
            progress::done();
        }
    }
    if training {
        let models: Vec<String> = if !args.model.is_empty() {
            args.model.clone()
        } else if args.tiny {
            train::TINY_SUITE.map(String::from).to_vec()
        } else {
            train::SUITE.map(String::from).to_vec()
        };
        train::sweep(args, &models, &mut report);
    }
    report
}
