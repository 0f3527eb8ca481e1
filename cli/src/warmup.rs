//! `bastile warmup`: one training step of a model at each length given,
//! on random weights and tokens, so that every kernel those steps need is
//! compiled (with `--tune`, every candidate compiled and the fastest
//! picked) and kept in the kernel cache ([`bastile::kernel_cache`]) and
//! CubeCL's autotune cache. Later runs on this machine, or on machines
//! started from its disk image, then start training at once. Nothing else
//! is written.

use std::time::Instant;

use bastile::{BastileBackend, TunePolicy, WeightGradSum, set_tune_policy};
use bastile_models::{CausalLm, MicroBatch, OptimizerKind, TrainConfig, Trainer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Distribution, Int, Tensor};
use indicatif::{ProgressBar, ProgressStyle};

use crate::device::{DeviceKind, RunInfo, Task, dispatch};
use crate::source::ModelSource;
use crate::{CliError, DTypeArg};

/// What `warmup` is told (the command line's options).
#[derive(Clone, Debug)]
pub struct WarmupOptions {
    /// A preset name or a model directory (only its `config.json` is
    /// read).
    pub model: String,
    /// Sequence lengths, one step each, in this order.
    pub lengths: Vec<usize>,
    /// Rows per micro-batch.
    pub batch_size: usize,
    /// Rows packed with documents (`bastile finetune`'s default), whose
    /// attention kernels differ from those of padded rows.
    pub packing: bool,
    pub dtype: DTypeArg,
    pub optimizer: OptimizerKind,
    pub master_weights: bool,
    /// How the fused loss sums the output layer's gradient over its chunks.
    pub loss_weight_grad_sum: WeightGradSum,
    /// Benchmark every launch candidate of the tuned ops
    /// ([`TunePolicy::Full`]) instead of compiling their defaults.
    pub tune: bool,
    pub seed: u64,
    /// Draw a progress bar (else a line per length).
    pub progress: bool,
}

/// How long each length's step took, compilation and tuning included.
#[derive(Clone, Debug, PartialEq)]
pub struct WarmupReport {
    pub steps: Vec<(usize, f64)>,
}

struct Warmup(WarmupOptions);

/// `bastile warmup` on the backend `device` and `bastile` select.
pub fn run(
    device: DeviceKind,
    bastile: bool,
    options: WarmupOptions,
) -> Result<WarmupReport, CliError> {
    dispatch(device, bastile, Warmup(options))
}

impl Task for Warmup {
    type Output = WarmupReport;

    fn models(&self) -> Vec<String> {
        vec![self.0.model.clone()]
    }

    fn run<B>(self, device: B::Device, info: RunInfo) -> Result<WarmupReport, CliError>
    where
        B: AutodiffBackend + BastileBackend,
        B::InnerBackend: BastileBackend,
    {
        let o = self.0;
        if o.lengths.is_empty() || o.lengths.contains(&0) {
            return Err(CliError::Usage(
                "--seq needs one or more lengths above 0 (e.g. --seq 1024,2048,4096)".into(),
            ));
        }
        if o.batch_size == 0 {
            return Err(CliError::Usage("--batch-size must be at least 1".into()));
        }
        let config = ModelSource::parse(&o.model)?.config()?;
        if let Some(&longest) = o.lengths.iter().max()
            && longest > config.max_position_embeddings
        {
            return Err(CliError::Usage(format!(
                "--seq {longest} is longer than the model's context ({} positions)",
                config.max_position_embeddings
            )));
        }
        if o.tune {
            set_tune_policy(TunePolicy::Full);
        }
        B::seed(&device, o.seed);
        let dtype = o.dtype.resolve(&info)?;
        let mut model = CausalLm::<B>::init(&config, &device)?.with_dtype(dtype)?;
        let mut trainer = Trainer::<B>::new(TrainConfig {
            optimizer: o.optimizer,
            master_weights: o.master_weights,
            loss_weight_grad_sum: o.loss_weight_grad_sum,
            ..Default::default()
        })?;
        let bar = progress_bar(&o);
        let mut report = WarmupReport { steps: Vec::new() };
        for &len in &o.lengths {
            bar.set_message(format!("{len} tokens a row: compiling"));
            let batch = random_batch::<B>(o.batch_size, len, config.vocab_size, o.packing, &device);
            let started = Instant::now();
            let (next, out) = trainer.step(model, std::slice::from_ref(&batch));
            model = next;
            out?;
            let seconds = started.elapsed().as_secs_f64();
            report.steps.push((len, seconds));
            bar.inc(1);
            let line = format!("{len} tokens a row: {seconds:.1} s");
            if o.progress {
                bar.println(line);
            } else {
                eprintln!("bastile warmup: {line}");
            }
        }
        bar.finish_and_clear();
        Ok(report)
    }
}

/// A bar over the lengths when drawing one, else a hidden one.
fn progress_bar(o: &WarmupOptions) -> ProgressBar {
    if !o.progress {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(o.lengths.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {pos}/{len} lengths {msg}")
            .expect("a valid template"),
    );
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    bar
}

/// `rows` rows of `len` random tokens, trained on themselves; packed, each
/// row is one document (positions from 0), which selects the document-aware
/// kernels that packed rows run.
pub fn random_batch<B: AutodiffBackend>(
    rows: usize,
    len: usize,
    vocab: usize,
    packed: bool,
    device: &B::Device,
) -> MicroBatch<B> {
    let ids = Tensor::<B, 2, Int>::random(
        [rows, len],
        Distribution::Uniform(0.0, vocab as f64),
        device,
    );
    let positions = packed.then(|| {
        Tensor::<B, 1, Int>::arange(0..len as i64, device)
            .unsqueeze::<2>()
            .repeat_dim(0, rows)
    });
    MicroBatch {
        ids: ids.clone(),
        labels: ids,
        positions,
    }
}
