//! End-to-end training steps: a model preset with random weights in bf16,
//! AdamW, one micro-batch of random tokens per step; milliseconds per step,
//! tokens per second and reserved device memory.
//!
//! Each (implementation, batch, sequence) runs in a process of its own (the
//! binary runs itself again with `--impl`), so every memory reading starts
//! from an empty pool and an out-of-memory failure is recorded as such
//! instead of ending the sweep.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Instant;

use bastile::{Bastile, BastileBackend, Patches};
use bastile_models::{CausalLm, MicroBatch, TrainConfig, Trainer, presets};
use burn::backend::Autodiff;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Distribution, Int, Tensor};
use clap::ValueEnum;
use serde::{Deserialize, Serialize};

use crate::Args;
use crate::report::Report;

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
    pub tokens_per_s: Option<f64>,
    /// Reserved device memory after the timed steps.
    pub peak_mib: Option<f64>,
    /// Why the run failed (out of memory, ...).
    pub error: Option<String>,
}

/// The line prefix a child process reports its row with.
const ROW_TAG: &str = "BASTILE_TRAIN_ROW ";

/// Runs every (implementation, batch, seq) of `args` in child processes.
pub fn sweep(args: &Args, report: &mut Report) {
    let Some(model) = &args.model else { return };
    let impls = match args.implementation {
        Some(i) => vec![i],
        None => TrainImpl::value_variants().to_vec(),
    };
    let exe = std::env::current_exe().expect("the benchmark's own path");
    for &batch in &args.batch {
        for &seq in &args.seq {
            for &imp in &impls {
                eprintln!("== train {model} batch {batch} seq {seq}: {}", imp.name());
                let mut row = child(&exe, args, model, batch, seq, imp);
                if args.attention != crate::AttentionArg::Auto && imp != TrainImpl::Burn {
                    row.implementation =
                        format!("{}, {} attention", row.implementation, attention_name(args));
                }
                match (&row.ms_per_step, &row.error) {
                    (Some(ms), _) => eprintln!(
                        "   {ms:.1} ms/step, {:.0} tokens/s, {:.0} MiB reserved",
                        row.tokens_per_s.unwrap_or(f64::NAN),
                        row.peak_mib.unwrap_or(f64::NAN)
                    ),
                    (None, Some(e)) => eprintln!("   failed: {e}"),
                    (None, None) => {}
                }
                report.train.push(row);
            }
        }
    }
}

fn child(
    exe: &std::path::Path,
    args: &Args,
    model: &str,
    batch: usize,
    seq: usize,
    imp: TrainImpl,
) -> TrainRow {
    let failed = |error: String| TrainRow {
        model: model.into(),
        batch,
        seq,
        dtype: "bf16".into(),
        implementation: imp.name().into(),
        ms_per_step: None,
        tokens_per_s: None,
        peak_mib: None,
        error: Some(error),
    };
    let runtime = args
        .runtime
        .to_possible_value()
        .expect("runtime names")
        .get_name()
        .to_string();
    let imp_name = imp.to_possible_value().expect("impl names");
    let spawned = Command::new(exe)
        .args(["--runtime", &runtime, "--model", model, "--impl"])
        .arg(imp_name.get_name())
        .args(["--batch", &batch.to_string(), "--seq", &seq.to_string()])
        .args(["--steps", &args.steps.to_string(), "--child"])
        .args(["--attention", attention_name(args)])
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
    let echo = std::thread::spawn(move || {
        let mut tail = Vec::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("   | {line}");
            tail.push(line);
            if tail.len() > 8 {
                tail.remove(0);
            }
        }
        tail
    });
    let stdout = proc.stdout.take().expect("piped");
    let row = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .find_map(|l| l.strip_prefix(ROW_TAG).map(str::to_owned));
    let status = proc.wait();
    let tail = echo.join().unwrap_or_default();
    match row.map(|r| serde_json::from_str::<TrainRow>(&r)) {
        Some(Ok(row)) => row,
        Some(Err(e)) => failed(format!("unreadable result: {e}")),
        None => {
            let text = tail.join(" / ");
            // CubeCL reports a failed device allocation as a buffer it
            // "can't allocate".
            let oom = ["out of memory", "OutOfMemory", "can't allocate buffer"]
                .iter()
                .any(|m| text.contains(m));
            failed(if oom {
                "out of memory".into()
            } else {
                let first = tail
                    .iter()
                    .find(|l| l.contains("panicked") || l.contains("error"));
                let why = first.or(tail.last()).map_or("", String::as_str);
                format!("exited with {status:?}: {why}")
            })
        }
    }
}

fn attention_name(args: &Args) -> &'static str {
    match args.attention {
        crate::AttentionArg::Auto => "auto",
        crate::AttentionArg::Tiled => "tiled",
        crate::AttentionArg::Products => "products",
    }
}

/// In the child: measures one configuration and prints its row.
pub fn run_child<R, B>(device: &B::Device, args: &Args, imp: TrainImpl)
where
    R: cubecl::Runtime<Device = B::Device>,
    B: bastile::ops::KernelBackend + BastileBackend,
{
    let model = args.model.as_deref().expect("--model");
    let (batch, seq) = (args.batch[0], args.seq[0]);
    let row = match imp {
        TrainImpl::Burn => measure::<R, Autodiff<B>>(device, model, imp, batch, seq, args.steps),
        TrainImpl::BastileKernels | TrainImpl::Bastile => {
            bastile::apply(Patches {
                matmul: imp == TrainImpl::Bastile,
                ..Patches::default()
            });
            measure::<R, Autodiff<Bastile<B>>>(device, model, imp, batch, seq, args.steps)
        }
    };
    let row = row.unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(1)
    });
    println!(
        "{ROW_TAG}{}",
        serde_json::to_string(&row).expect("rows serialize")
    );
}

fn measure<R, A>(
    device: &A::Device,
    model: &str,
    imp: TrainImpl,
    batch: usize,
    seq: usize,
    steps: usize,
) -> Result<TrainRow, String>
where
    R: cubecl::Runtime<Device = A::Device>,
    A: AutodiffBackend + BastileBackend,
    A::InnerBackend: BastileBackend,
{
    let config = presets::preset(model).map_err(|e| e.to_string())?;
    let started = Instant::now();
    let mut lm = CausalLm::<A>::init(&config, device)
        .and_then(|m| m.with_dtype(DType::BF16))
        .map_err(|e| e.to_string())?;
    let vocab = lm.config.vocab_size as f64;
    let ids = Tensor::<A, 2, Int>::random([batch, seq], Distribution::Uniform(0.0, vocab), device);
    let data = [MicroBatch {
        ids: ids.clone(),
        labels: ids,
    }];
    let mut trainer = Trainer::<A>::new(TrainConfig {
        learning_rate: 1e-5,
        ..TrainConfig::default()
    })
    .map_err(|e| e.to_string())?;
    // Two warm-up steps: kernel compilation and autotuning happen there.
    // Every step ends with its loss read back, i.e. a device sync.
    let warmup = 2;
    let mut times = Vec::new();
    for i in 0..warmup + steps.max(1) {
        let t = Instant::now();
        let (next, out) = trainer.step(lm, &data).map_err(|e| e.to_string())?;
        lm = next;
        let secs = t.elapsed().as_secs_f64();
        eprintln!(
            "step {i}: loss {:.4}, {:.1} ms{}",
            out.loss,
            secs * 1e3,
            if i < warmup { " (warm-up)" } else { "" }
        );
        if i >= warmup {
            times.push(secs);
        }
    }
    times.sort_by(f64::total_cmp);
    let secs = times[times.len() / 2];
    let usage = R::client(device)
        .memory_usage()
        .map_err(|e| format!("{e:?}"))?;
    eprintln!("done in {:.0} s", started.elapsed().as_secs_f64());
    Ok(TrainRow {
        model: model.into(),
        batch,
        seq,
        dtype: "bf16".into(),
        implementation: imp.name().into(),
        ms_per_step: Some(secs * 1e3),
        tokens_per_s: Some((batch * seq) as f64 / secs),
        peak_mib: Some(usage.bytes_reserved as f64 / (1u64 << 20) as f64),
        error: None,
    })
}
