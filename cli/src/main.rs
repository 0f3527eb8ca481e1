//! `bastile finetune` and `bastile generate`: see `bastile --help`.

use std::io::IsTerminal;
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::process::ExitCode;

use bastile::kernel_cache::{KERNEL_CACHE_VAR, KernelCache};
use bastile_cli::chat::ChatFormat;
use bastile_cli::device::DeviceKind;
use bastile_cli::finetune::{self, FinetuneOptions};
use bastile_cli::generate::{self, GenerateOptions};
use bastile_cli::warmup::{self, WarmupOptions};
use bastile_cli::{CliError, DTypeArg, ExpertsArg, WeightGradSumArg};
use bastile_models::lora::parse_targets;
use bastile_models::{Checkpointing, LoraConfig, OptimizerKind};
use clap::{Args, Parser, Subcommand, ValueEnum};

#[derive(Parser)]
#[command(
    name = "bastile",
    version,
    about = "Finetune and run Qwen3, Llama 3.x and GPT-OSS models with Bastile's fused kernels"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Args, Clone)]
struct Common {
    /// Where to run: CUDA if present (else the CPU), or a given device.
    #[arg(long, value_enum, default_value = "auto")]
    device: DeviceKind,
    /// Parameter dtype (bf16 on CUDA, f32 elsewhere by default).
    #[arg(long, value_enum, default_value = "auto")]
    dtype: DTypeArg,
    /// Run without Bastile's kernels: Burn's own ops (the baseline).
    #[arg(long)]
    no_bastile: bool,
    /// An HF `tokenizer.json` (default: the model directory's).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// The chat format (default: the model family's).
    #[arg(long, value_enum)]
    chat_format: Option<ChatFormat>,
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

// Parsed once per process: the finetune variant's size costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Finetune a model on a JSONL instruction data set. With no
    /// arguments: the tiny preset on the embedded data set.
    Finetune {
        /// A model directory (HF checkpoint or a checkpoint of this
        /// command) or a preset name.
        #[arg(long, default_value = "bastile-tiny")]
        model: String,
        /// JSONL, one example a line: {"instruction", "input"?, "output"}
        /// or {"messages": [{"role", "content"}, ...]} (default: the
        /// embedded data set).
        #[arg(long)]
        data: Option<PathBuf>,
        /// Output directory: checkpoint-N/ and final/ (HF safetensors).
        #[arg(long, default_value = "bastile-out")]
        output: PathBuf,
        /// Examples are cut to this many tokens (default: the model's
        /// context, at most 2048).
        #[arg(long)]
        max_seq: Option<usize>,
        /// Rows per micro-batch (each packing several examples), or
        /// examples per micro-batch with --no-packing.
        #[arg(long, default_value_t = 8)]
        batch_size: usize,
        /// One example per row, padded to the batch's longest, instead of
        /// packing whole examples into rows as long as the longest example
        /// (each attending only to itself, its positions restarting at 0).
        #[arg(long)]
        no_packing: bool,
        /// Pad batches to a multiple of this many tokens (default: 64 on a
        /// GPU, where each new length compiles and tunes new kernels; 1 on
        /// the CPU).
        #[arg(long)]
        pad_to_multiple: Option<usize>,
        /// Micro-batches per optimizer step (per GPU with --devices).
        #[arg(long, default_value_t = 1)]
        grad_accum: usize,
        /// Train data-parallel on the first N CUDA GPUs: a replica of the
        /// model on each, every one taking its own micro-batches, the
        /// gradients summed through NCCL (libnccl.so on the library path)
        /// before each update. Checkpoints are written once.
        #[arg(long, value_name = "N", default_value_t = 1)]
        devices: usize,
        /// Activation checkpointing: keep only each layer's input and run
        /// the layer again in the backward pass (one more forward pass of
        /// the layers for far less memory). With N, only every N-th layer
        /// (0, N, 2N, ...).
        #[arg(long, value_name = "N", num_args = 0..=1, default_missing_value = "1")]
        checkpointing: Option<usize>,
        /// GPT-OSS: how the experts run. `routed` (the default): each
        /// expert on the tokens the router sent it (`top_k / experts` of
        /// the expert work, one read of the routing per layer); `dense`:
        /// every expert on every token, weighted 0 where not chosen.
        #[arg(long, value_enum, value_name = "HOW")]
        experts: Option<ExpertsArg>,
        /// GPT-OSS: add the router's load-balancing loss (HF's
        /// `output_router_logits`) with this weight to the training loss
        /// (0: none; default: as the model's config.json says).
        #[arg(long, value_name = "COEF")]
        router_aux_loss: Option<f64>,
        /// Record a training step as CUDA graphs and replay it for the
        /// steps of the same shapes (one GPU; packed rows, the default,
        /// give every step one shape): the host queues a step in a few graph launches
        /// instead of every kernel. Off CUDA, or when a step cannot be
        /// recorded, training goes on plainly with a note why.
        #[arg(long)]
        step_graphs: bool,
        /// Passes over the data (default: 60 for the tiny preset, which
        /// starts from random weights, else 3).
        #[arg(long)]
        epochs: Option<usize>,
        /// Optimizer steps (overrides --epochs).
        #[arg(long)]
        steps: Option<usize>,
        /// Peak learning rate (default 3e-3 for the tiny preset, else 2e-5).
        #[arg(long)]
        lr: Option<f64>,
        /// Linear warmup steps (default 5% of the steps).
        #[arg(long)]
        warmup_steps: Option<usize>,
        #[arg(long, default_value_t = 0.0)]
        weight_decay: f32,
        /// Clip the global gradient norm (0: no clipping).
        #[arg(long, default_value_t = 1.0)]
        max_grad_norm: f32,
        /// Bastile's fused AdamW, or Burn's AdamW.
        #[arg(long, value_enum, default_value_t = OptimizerArg::Fused)]
        optimizer: OptimizerArg,
        /// Keep f32 moments and an f32 master copy of bf16/f16 parameters
        /// (HF Trainer's `bf16=True`); fused AdamW only.
        #[arg(long)]
        master_weights: bool,
        /// How the fused loss sums the output layer's gradient over its
        /// chunks of tokens: `chunks` (chunk by chunk in the weight's
        /// dtype, as Liger-Kernel does) or `exact` (a second pass over the
        /// vocabulary, rounded once: a fourth product over the logits). A
        /// run saved before this option existed resumes with `exact`.
        #[arg(long, value_enum, default_value_t = WeightGradSumArg::Chunks)]
        loss_weight_grad_sum: WeightGradSumArg,
        /// Save a checkpoint every N steps (`OUTPUT/checkpoint-N`, written
        /// whole or not at all).
        #[arg(long)]
        save_every: Option<usize>,
        /// JSONL evaluation data (the training data's format): its mean
        /// loss is reported every `--eval-every` steps and at the end.
        #[arg(long, value_name = "FILE")]
        eval_data: Option<PathBuf>,
        /// Hold this fraction of the training examples out as the
        /// evaluation set (instead of `--eval-data`).
        #[arg(long, value_name = "FRACTION")]
        eval_fraction: Option<f64>,
        /// Evaluate every N steps (default: only at the end).
        #[arg(long, value_name = "N")]
        eval_every: Option<usize>,
        /// Keep only the N latest checkpoints.
        #[arg(long)]
        keep_last: Option<usize>,
        /// Skip a step whose loss or gradient is not finite, with a
        /// warning, instead of stopping (several in a row still stop).
        #[arg(long)]
        skip_nonfinite: bool,
        /// Continue the run that wrote this checkpoint directory: model,
        /// tokenizer, optimizer state, step, schedule and data position come
        /// from it (`--model` is not read). Pass the run's other options
        /// again; a setting that would change the run is an error.
        #[arg(long, value_name = "DIR")]
        resume: Option<PathBuf>,
        /// Print a line every N steps when no progress bar is drawn.
        #[arg(long, default_value_t = 10)]
        log_every: usize,
        #[command(flatten)]
        lora: LoraArgs,
        #[command(flatten)]
        common: Common,
    },
    /// Compile the kernels a model's training needs at the given lengths
    /// (one step on random weights and tokens per length), so training
    /// runs on this machine start at once; nothing is written but the
    /// kernel caches.
    Warmup {
        /// A model directory (only its config.json is read) or a preset
        /// name.
        #[arg(long)]
        model: String,
        /// Sequence lengths, comma-separated: the padded or packed row
        /// lengths training will meet (with finetune's defaults, multiples
        /// of 64 up to --max-seq).
        #[arg(long, value_delimiter = ',', required = true)]
        seq: Vec<usize>,
        /// Rows per micro-batch.
        #[arg(long, default_value_t = 8)]
        batch_size: usize,
        /// Rows of one padded example each (finetune's --no-packing)
        /// instead of packed rows, whose attention kernels differ.
        #[arg(long)]
        no_packing: bool,
        /// Benchmark every launch candidate of the tuned kernels and keep
        /// the fastest (BASTILE_TUNE=full for the runs that follow):
        /// minutes instead of seconds, for the last few percent of a step.
        #[arg(long)]
        tune: bool,
        #[arg(long, value_enum, default_value = "fused")]
        optimizer: OptimizerArg,
        /// f32 moments and master weights for bf16/f16 parameters.
        #[arg(long)]
        master_weights: bool,
        /// As `finetune --loss-weight-grad-sum`.
        #[arg(long, value_enum, default_value_t = WeightGradSumArg::Chunks)]
        loss_weight_grad_sum: WeightGradSumArg,
        #[command(flatten)]
        common: Common,
    },
    /// Reply to prompts with one or more models, side by side.
    Generate {
        /// Model directories or presets (repeat to compare models).
        #[arg(long, required = true)]
        model: Vec<String>,
        /// Prompts (repeat for several).
        #[arg(long, required = true)]
        prompt: Vec<String>,
        #[arg(long, default_value_t = 128)]
        max_new_tokens: usize,
        /// Sampling temperature; 0 is greedy.
        #[arg(long, default_value_t = 0.0)]
        temperature: f64,
        /// Nucleus sampling mass (with temperature > 0).
        #[arg(long, default_value_t = 0.9)]
        top_p: f64,
        /// A LoRA adapter directory (PEFT's format) to add to every model.
        /// A model directory that is itself an adapter directory loads its
        /// base model (`base_model_name_or_path`) without this.
        #[arg(long, value_name = "DIR")]
        adapter: Option<PathBuf>,
        #[command(flatten)]
        common: Common,
    },
}

/// LoRA options of `finetune`.
#[derive(Args, Clone)]
struct LoraArgs {
    /// Train LoRA adapters of this rank on the frozen model instead of
    /// every weight; checkpoints and final/ then hold the adapters in
    /// PEFT's format.
    #[arg(long, value_name = "R")]
    lora_rank: Option<usize>,
    /// LoRA alpha: the update is scaled by alpha / rank (default: the
    /// rank, a scale of 1).
    #[arg(long, value_name = "A", requires = "lora_rank")]
    lora_alpha: Option<f64>,
    /// Dropout on the adapters' input while training.
    #[arg(long, value_name = "P", default_value_t = 0.0, requires = "lora_rank")]
    lora_dropout: f64,
    /// The weights that get adapters: q,k,v,o,gate,up,down, for GPT-OSS
    /// q,k,v,o,router,experts.gate_up,experts.down (or `all`, every one
    /// the model has; `all-linear`, its linear layers).
    #[arg(
        long,
        value_name = "LIST",
        default_value = "all",
        requires = "lora_rank"
    )]
    lora_targets: String,
    /// rsLoRA: scale the update by alpha / sqrt(rank).
    #[arg(long, requires = "lora_rank")]
    rslora: bool,
    /// Also write final-merged/: the adapters folded into the weights, an
    /// HF checkpoint.
    #[arg(long)]
    merge_lora: bool,
}

impl LoraArgs {
    fn config(&self) -> Result<Option<LoraConfig>, CliError> {
        let Some(rank) = self.lora_rank else {
            return Ok(None);
        };
        Ok(Some(
            LoraConfig::new(rank)
                .with_alpha(self.lora_alpha.unwrap_or(rank as f64))
                .with_dropout(self.lora_dropout)
                .with_rslora(self.rslora)
                .with_targets(parse_targets(&self.lora_targets)?),
        ))
    }
}

/// `--optimizer`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum OptimizerArg {
    /// Bastile's fused AdamW: a few launches for all parameters, the clip
    /// folded in.
    Fused,
    /// Burn's AdamW after a separate global-norm clip.
    Burn,
}

impl OptimizerArg {
    fn kind(self) -> OptimizerKind {
        match self {
            Self::Fused => OptimizerKind::Fused,
            Self::Burn => OptimizerKind::Burn,
        }
    }
}

/// `--checkpointing [N]`.
fn checkpointing_arg(every: Option<usize>) -> Result<Checkpointing, CliError> {
    match every.map(NonZeroUsize::new) {
        None => Ok(Checkpointing::Off),
        Some(Some(n)) => Ok(Checkpointing::Every(n)),
        Some(None) => Err(CliError::Usage(
            "--checkpointing 0: checkpoint every N-th layer needs N of at least 1".into(),
        )),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Running out of GPU memory is one error naming the step, not a panic
    // of every thread that meets the missing buffer.
    bastile::launch_failure::watch_out_of_memory();
    // Kernels compiled by an earlier run on this machine load from disk.
    let cache = bastile::kernel_cache::use_kernel_cache();
    match run(cli, &cache) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli, cache: &KernelCache) -> Result<(), CliError> {
    match cli.command {
        Command::Finetune {
            model,
            data,
            output,
            max_seq,
            batch_size,
            no_packing,
            pad_to_multiple,
            grad_accum,
            devices,
            checkpointing,
            experts,
            router_aux_loss,
            step_graphs,
            epochs,
            steps,
            lr,
            warmup_steps,
            weight_decay,
            max_grad_norm,
            optimizer,
            master_weights,
            loss_weight_grad_sum,
            save_every,
            keep_last,
            skip_nonfinite,
            resume,
            eval_data,
            eval_fraction,
            eval_every,
            log_every,
            lora,
            common,
        } => {
            let options = FinetuneOptions {
                model,
                tokenizer: common.tokenizer,
                data,
                eval_data,
                eval_fraction,
                eval_every,
                chat_format: common.chat_format,
                output,
                max_seq,
                batch_size,
                packing: !no_packing,
                pad_to_multiple,
                grad_accum,
                epochs,
                steps,
                learning_rate: lr,
                warmup_steps,
                weight_decay,
                max_grad_norm: (max_grad_norm > 0.0).then_some(max_grad_norm),
                optimizer: optimizer.kind(),
                master_weights,
                loss_weight_grad_sum: loss_weight_grad_sum.sum(),
                save_every,
                keep_last,
                skip_nonfinite,
                resume,
                dtype: common.dtype,
                seed: common.seed,
                progress: std::io::stderr().is_terminal(),
                log_every,
                lora: lora.config()?,
                merge_lora: lora.merge_lora,
                devices,
                checkpointing: checkpointing_arg(checkpointing)?,
                expert_routing: experts.map(ExpertsArg::routing),
                router_aux_loss,
                step_graphs,
            };
            finetune::run(common.device, !common.no_bastile, options)?;
        }
        Command::Warmup {
            model,
            seq,
            batch_size,
            no_packing,
            tune,
            optimizer,
            master_weights,
            loss_weight_grad_sum,
            common,
        } => {
            let options = WarmupOptions {
                model,
                lengths: seq,
                batch_size,
                packing: !no_packing,
                dtype: common.dtype,
                optimizer: optimizer.kind(),
                master_weights,
                loss_weight_grad_sum: loss_weight_grad_sum.sum(),
                tune,
                seed: common.seed,
                progress: std::io::stderr().is_terminal(),
            };
            let report = warmup::run(common.device, !common.no_bastile, options)?;
            let total: f64 = report.steps.iter().map(|(_, s)| s).sum();
            let kept = match cache {
                KernelCache::On(dir) => format!(
                    "training runs on this machine take their kernels from {}",
                    dir.display()
                ),
                KernelCache::Configured => {
                    "training runs on this machine take their kernels from the cache cubecl.toml names"
                        .to_string()
                }
                _ => format!(
                    "but the kernel cache is off ({KERNEL_CACHE_VAR}), so later runs compile them again"
                ),
            };
            eprintln!(
                "warmed up {} length(s) in {total:.1} s; {kept}",
                report.steps.len()
            );
        }
        Command::Generate {
            model,
            prompt,
            max_new_tokens,
            temperature,
            top_p,
            adapter,
            common,
        } => {
            // Each prompt once (a repeated one is asked once), in the order
            // given, with every model's answer under it, side by side.
            let mut prompts: Vec<String> = Vec::new();
            for p in &prompt {
                if !prompts.contains(p) {
                    prompts.push(p.clone());
                }
            }
            let options = GenerateOptions {
                models: model,
                tokenizer: common.tokenizer,
                chat_format: common.chat_format,
                prompts: prompts.clone(),
                max_new_tokens,
                temperature,
                top_p,
                seed: common.seed,
                dtype: common.dtype,
                adapter,
            };
            let replies = generate::run(common.device, !common.no_bastile, options)?;
            for p in &prompts {
                println!("\n### {p}");
                for r in replies.iter().filter(|r| &r.prompt == p) {
                    println!("[{}] {}", r.model, r.text.trim());
                }
            }
        }
    }
    Ok(())
}
