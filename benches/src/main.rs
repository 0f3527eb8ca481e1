//! `bastile-bench`: Bastile's fused kernels against Burn's composite ops on
//! one device, in one process, with the device's measured copy bandwidth as
//! the yardstick. `cargo xtask bench` builds and runs it.

mod attention;
mod copy;
mod flce;
mod geglu;
mod matmul;
mod passes;
mod report;
mod rms_norm;
mod rope;
mod swiglu;
mod timing;
mod train;

use clap::{Parser, ValueEnum};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Runtime {
    Cuda,
    Wgpu,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OpName {
    RmsNorm,
    Swiglu,
    Geglu,
    Rope,
    Flce,
    Matmul,
    Attention,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum AttentionArg {
    Auto,
    Tiled,
    Products,
}

impl AttentionArg {
    /// Makes this choice the process's attention kernels.
    pub fn apply(self) {
        bastile::set_attention_kernels(match self {
            Self::Auto => bastile::AttentionKernels::Auto,
            Self::Tiled => bastile::AttentionKernels::Tiled,
            Self::Products => bastile::AttentionKernels::MatrixProducts { block_rows: 0 },
        });
    }
}

#[derive(Parser, Debug)]
#[command(about = "Benchmarks Bastile's fused kernels against Burn's composite ops")]
pub struct Args {
    /// Which op to benchmark (all when omitted).
    #[arg(long, value_enum)]
    pub op: Option<OpName>,
    /// The runtime to run on.
    #[arg(long, value_enum)]
    pub runtime: Runtime,
    /// Use the small shapes meant for the software Vulkan driver.
    #[arg(long)]
    pub tiny: bool,
    /// Write the results as JSON (and Markdown beside it, `.md`).
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
    /// With `--op flce`: run only this configuration (index into the list
    /// the run prints), so each can be measured in a fresh process whose
    /// memory pool holds nothing else.
    #[arg(long)]
    pub case: Option<usize>,
    /// Timed repetitions per measurement (the median is reported).
    #[arg(long, default_value_t = 15)]
    pub samples: usize,
    /// Train this model preset end to end (random weights, bf16, AdamW)
    /// instead of benchmarking kernels, e.g. `qwen3-0.6b`.
    #[arg(long)]
    pub model: Option<String>,
    /// With `--model` or `--op attention`: sequence lengths to sweep.
    #[arg(long, value_delimiter = ',', default_value = "4096")]
    pub seq: Vec<usize>,
    /// With `--model`: batch sizes to sweep.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub batch: Vec<usize>,
    /// With `--model`: only this implementation (all three when omitted);
    /// with `--op attention`: `burn` or `bastile`.
    #[arg(long = "impl", value_enum)]
    pub implementation: Option<train::TrainImpl>,
    /// With `--model`: timed training steps (after two warm-up steps).
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// With `--model` or `--op attention`: which attention kernels
    /// Bastile runs (`auto`: matrix products on cuBLASLt where the matmul
    /// patch runs there, tiled kernels elsewhere).
    #[arg(long, value_enum, default_value = "auto")]
    pub attention: AttentionArg,
    /// Internal: this process measures one training configuration.
    #[arg(long, hide = true)]
    pub child: bool,
}

fn main() {
    let args = Args::parse();
    let report = match args.runtime {
        Runtime::Cuda => {
            #[cfg(feature = "cuda")]
            {
                run::<cubecl::cuda::CudaRuntime, burn::backend::Cuda>(&args, "cuda")
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
    println!("{}", report.markdown());
    if let Some(path) = &args.out {
        if let Err(e) = report.write(path) {
            eprintln!("could not write {}: {e}", path.display());
            std::process::exit(1);
        }
        eprintln!("results written to {} (and .md)", path.display());
    }
}

fn run<R, B>(args: &Args, runtime: &str) -> report::Report
where
    R: cubecl::Runtime<Device = B::Device>,
    B: bastile::ops::KernelBackend + bastile::BastileBackend,
{
    let device = B::Device::default();
    args.attention.apply();
    if args.model.is_some() {
        let mut report = report::Report::new(runtime, &B::name(&device), args.tiny, f64::NAN);
        match args.implementation {
            Some(imp) if args.child => {
                train::run_child::<R, B>(&device, args, imp);
                std::process::exit(0)
            }
            _ => train::sweep(args, &mut report),
        }
        return report;
    }
    // The loss benchmark reports flops and memory, not bandwidth, and its
    // memory readings must not include the copy test's buffers.
    let copy_gbs = if matches!(
        args.op,
        Some(OpName::Flce | OpName::Matmul | OpName::Attention)
    ) {
        f64::NAN
    } else {
        copy::measure_copy_bandwidth::<R>(&device, args.tiny, args.samples)
    };
    let mut report = report::Report::new(runtime, &B::name(&device), args.tiny, copy_gbs);
    eprintln!("device copy bandwidth: {copy_gbs:.1} GB/s (read + write)");
    let wanted = |op| args.op.is_none() || args.op == Some(op);
    if wanted(OpName::RmsNorm) {
        rms_norm::bench::<B>(&device, args, &mut report);
    }
    if wanted(OpName::Swiglu) {
        swiglu::bench::<B>(&device, args, &mut report);
    }
    if wanted(OpName::Geglu) {
        geglu::bench::<B>(&device, args, &mut report);
    }
    if wanted(OpName::Rope) {
        rope::bench::<B>(&device, args, &mut report);
    }
    if wanted(OpName::Flce) {
        flce::bench::<R, B>(&device, args, &mut report);
    }
    if wanted(OpName::Matmul) {
        matmul::bench::<B>(&device, args, &mut report);
    }
    if wanted(OpName::Attention) {
        attention::bench::<R, B>(&device, args, &mut report);
    }
    report
}
