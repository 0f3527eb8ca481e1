//! Data-parallel training (`bastile_models::parallel`): workers that sum
//! their gradients train as one worker accumulating all their
//! micro-batches; a check failing on one worker skips the step on all; a
//! worker that fails ends the run with an error naming it, never a hang.
//!
//! The workers sum through the host rendezvous, which every backend has:
//! on the CPU (`Autodiff<NdArray>`) always, and under Bastile on the wgpu
//! runtime when it is selected. NCCL on several GPUs is checked by the
//! training benchmark's `--devices` runs.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use bastile::BastileBackend;
use bastile_cubecl::testing::runtime_selected;
use bastile_models::{
    CausalLm, Checkpointing, Collective, DataParallelOptions, MicroBatch, ModelError, TrainConfig,
    Trainer,
};
use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, TensorData};

use crate::training::params;

type Cpu = burn::backend::Autodiff<burn::backend::NdArray>;

/// AdamW with an epsilon near the gradients' size and no clip, so that a
/// gradient scaled by a constant (a wrong token count) changes the update.
fn config() -> TrainConfig {
    TrainConfig {
        adam_epsilon: 1e-3,
        max_grad_norm: None,
        ..crate::training::config()
    }
}

/// The Qwen3 fixture (separate input and output embeddings).
fn load<B: AutodiffBackend>(device: &B::Device) -> CausalLm<B> {
    load_fixture("qwen3", device)
}

fn load_fixture<B: AutodiffBackend>(fixture: &str, device: &B::Device) -> CausalLm<B> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(fixture);
    CausalLm::<B>::from_hf_dir(dir, device).unwrap()
}

/// A `[2, 12]` micro-batch whose first `masked` labels are ignored (so
/// batches count different numbers of tokens); `bad` puts a label outside
/// the vocabulary at row 1, column 5.
fn batch<B: AutodiffBackend>(
    seed: i64,
    masked: usize,
    bad: bool,
    vocab: i64,
    device: &B::Device,
) -> MicroBatch<B> {
    batch_of(seed, masked, bad, vocab, 12, device)
}

/// [`batch`] with rows of `seq` tokens (at least 6).
fn batch_of<B: AutodiffBackend>(
    seed: i64,
    masked: usize,
    bad: bool,
    vocab: i64,
    seq: usize,
    device: &B::Device,
) -> MicroBatch<B> {
    let ids: Vec<i64> = (0..2 * seq as i64)
        .map(|i| (i * 131 + seed * 17) % vocab)
        .collect();
    let mut labels = ids.clone();
    labels[..masked].fill(-100);
    if bad {
        labels[seq + 5] = vocab + 3;
    }
    MicroBatch {
        ids: Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [2, seq]), device),
        labels: Tensor::<B, 2, Int>::from_data(TensorData::new(labels, [2, seq]), device),
        positions: None,
    }
}

/// Every parameter of a model (path → values).
type Params = Vec<(String, Vec<f32>)>;

/// `(loss, tokens)` of each step and the final parameters of `steps` steps
/// of the model in `fixture` on `batches` (every worker's, in order), on
/// `devices[0]` alone or, with a collective, data-parallel over `devices`.
fn run<B>(
    fixture: &str,
    devices: &[B::Device],
    collective: Option<Collective<B::InnerBackend>>,
    checkpointing: Checkpointing,
    batches: &[MicroBatch<B>],
    steps: usize,
) -> (Vec<(f64, usize)>, Params)
where
    B: AutodiffBackend + BastileBackend,
    B::InnerBackend: BastileBackend,
    CausalLm<B>: AutodiffModule<B> + Send + 'static,
    MicroBatch<B>: Send,
{
    let mut model = load_fixture::<B>(fixture, &devices[0])
        .with_checkpointing(checkpointing)
        .unwrap();
    let mut trainer = Trainer::<B>::new(config()).unwrap();
    if let Some(collective) = collective {
        trainer = trainer
            .data_parallel(&model, devices, collective, DataParallelOptions::default())
            .unwrap();
        assert_eq!(trainer.workers(), devices.len());
    }
    let mut outputs = Vec::new();
    for _ in 0..steps {
        let (m, out) = trainer.step(model, batches);
        model = m;
        let out = out.unwrap();
        outputs.push((out.loss, out.tokens));
    }
    assert_eq!(trainer.steps(), steps);
    (outputs, params(&model))
}

/// Largest difference between two parameter sets, relative to the
/// reference's largest magnitude per tensor.
fn max_relative_difference(a: &Params, b: &Params) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut worst = 0f32;
    for ((pa, va), (pb, vb)) in a.iter().zip(b) {
        assert_eq!(pa, pb);
        let scale = vb.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
        for (x, y) in va.iter().zip(vb) {
            worst = worst.max((x - y).abs() / scale);
        }
    }
    worst
}

/// What a case is, the fixture it trains, its workers, its checkpointing
/// and every worker's micro-batches, in order.
type Case<B> = (
    &'static str,
    &'static str,
    usize,
    Checkpointing,
    Vec<MicroBatch<B>>,
);

/// Data-parallel runs against one worker accumulating the same
/// micro-batches: the same losses and token counts, and the same
/// parameters (f32, 1e-5 of each tensor's largest value) after three steps.
/// `devices` has a device per worker (at most 3 are used); `collective`
/// sums over the first `n` of them.
fn workers_train_as_one<B>(
    devices: &[B::Device],
    collective: impl Fn(&[B::Device]) -> Collective<B::InnerBackend>,
    backend: &str,
) where
    B: AutodiffBackend + BastileBackend,
    B::InnerBackend: BastileBackend,
    CausalLm<B>: AutodiffModule<B> + Send + 'static,
    MicroBatch<B>: Send,
{
    let device = &devices[0];
    let vocab = load::<B>(device).config.vocab_size as i64;
    let b = |seed, masked| batch::<B>(seed, masked, false, vocab, device);
    // The Llama fixture ties its embeddings: the lookup's part of their
    // gradient is gathered from the workers' ids and output gradients,
    // here of other lengths on each worker.
    let tied_vocab = load_fixture::<B>("llama", device).config.vocab_size as i64;
    let tied = |seed, masked, seq| batch_of::<B>(seed, masked, false, tied_vocab, seq, device);
    let off = Checkpointing::Off;
    let cases: Vec<Case<B>> = vec![
        (
            "two workers, the same shard",
            "qwen3",
            2,
            off,
            vec![b(1, 3), b(1, 3)],
        ),
        (
            "two workers, shards of 21 and 9 tokens",
            "qwen3",
            2,
            off,
            vec![b(1, 2), b(2, 14)],
        ),
        (
            "three workers, two micro-batches each",
            "qwen3",
            3,
            off,
            vec![b(1, 3), b(2, 0), b(3, 7), b(4, 1), b(5, 11), b(6, 5)],
        ),
        (
            "two workers, two micro-batches each, every layer checkpointed",
            "qwen3",
            2,
            Checkpointing::ALL,
            vec![b(1, 3), b(2, 0), b(3, 7), b(4, 1)],
        ),
        (
            "one worker, rows of 12 and 7 tokens, tied embeddings",
            "llama",
            1,
            off,
            vec![tied(1, 2, 12), tied(2, 3, 7)],
        ),
        (
            "two workers, rows of 12 and 7 tokens, tied embeddings",
            "llama",
            2,
            off,
            vec![tied(1, 2, 12), tied(2, 3, 7)],
        ),
        (
            "three workers, rows of 9, 12 and 6 tokens twice, tied embeddings, every layer \
             checkpointed",
            "llama",
            3,
            Checkpointing::ALL,
            vec![
                tied(1, 3, 9),
                tied(2, 0, 9),
                tied(3, 1, 12),
                tied(4, 5, 12),
                tied(5, 2, 6),
                tied(6, 0, 6),
            ],
        ),
    ];
    for (what, fixture, workers, checkpointing, batches) in cases {
        let Some(devices) = devices.get(..workers) else {
            eprintln!("{backend}: {what}: needs {workers} devices");
            continue;
        };
        eprintln!("{backend}: {what}");
        let (expected, reference) = run::<B>(fixture, devices, None, checkpointing, &batches, 3);
        let (got, trained) = run::<B>(
            fixture,
            devices,
            Some(collective(devices)),
            checkpointing,
            &batches,
            3,
        );
        for ((loss, tokens), (ref_loss, ref_tokens)) in got.iter().zip(&expected) {
            assert_eq!(tokens, ref_tokens, "{backend}, {what}: tokens");
            assert!(
                (loss - ref_loss).abs() <= 1e-5 * ref_loss.abs(),
                "{backend}, {what}: loss {loss} against {ref_loss}"
            );
        }
        let worst = max_relative_difference(&trained, &reference);
        assert!(
            worst <= 1e-5,
            "{backend}, {what}: parameters differ by {worst:e}"
        );
    }
}

/// Sums on the host, every worker on the same device.
fn host<X: burn::tensor::backend::Backend>(devices: &[X::Device]) -> Collective<X> {
    Collective::host(devices.len(), Duration::from_secs(60))
}

#[test]
fn workers_summing_gradients_train_as_one_worker_accumulating() {
    workers_train_as_one::<Cpu>(&[Default::default(); 3], host, "cpu");
    if runtime_selected("wgpu", cfg!(feature = "wgpu")) {
        #[cfg(feature = "wgpu")]
        workers_train_as_one::<burn::backend::Autodiff<bastile::Bastile<burn::backend::Wgpu>>>(
            &vec![Default::default(); 3],
            host,
            "wgpu",
        );
    }
}

/// NCCL over the CUDA GPUs there are (one per worker), over Burn's fusion
/// stream (models with experts), which sums after the backward pass.
#[cfg(feature = "distributed")]
#[test]
fn nccl_workers_summing_after_the_backward_pass_train_as_one_worker_accumulating() {
    if runtime_selected("cuda", true) {
        nccl_workers_train_as_one::<bastile::Bastile<burn::backend::Cuda>>("cuda (NCCL)", false);
    }
}

/// NCCL over the CUDA GPUs there are, without the fusion stream (dense
/// models), summing each segment's gradients during the backward pass.
#[cfg(feature = "distributed")]
#[test]
fn nccl_workers_summing_during_the_backward_pass_train_as_one_worker_accumulating() {
    if runtime_selected("cuda", true) {
        nccl_workers_train_as_one::<bastile::Bastile<bastile::CudaDirect>>(
            "cuda direct (NCCL, during the backward pass)",
            true,
        );
    }
}

/// [`workers_train_as_one`] over NCCL, one worker on each CUDA GPU (up to
/// three), the gradients summed during the backward pass or after it.
#[cfg(feature = "distributed")]
fn nccl_workers_train_as_one<X>(backend: &str, during_backward: bool)
where
    X: BastileBackend + burn::tensor::backend::distributed::DistributedBackend,
    CausalLm<burn::backend::Autodiff<X>>:
        AutodiffModule<burn::backend::Autodiff<X>> + Send + 'static,
    MicroBatch<burn::backend::Autodiff<X>>: Send,
{
    use burn::tensor::backend::{Device, DeviceId};
    let count = X::device_count(0).min(3);
    let devices: Vec<X::Device> = (0..count)
        .map(|k| Device::from_id(DeviceId::new(0, k as u16)))
        .collect();
    eprintln!("{backend}: NCCL over {count} GPUs");
    workers_train_as_one::<burn::backend::Autodiff<X>>(
        &devices,
        |d| {
            let c = Collective::nccl(d).unwrap();
            if during_backward {
                c.during_backward()
            } else {
                c
            }
        },
        backend,
    );
}

/// A label out of range on worker 1 is the step's error, naming the
/// worker and the label; no replica changes, the step does not count, and
/// the next steps train as if it had never been tried.
#[test]
fn a_check_failing_on_one_worker_skips_the_step_on_every_worker() {
    let device = Default::default();
    let vocab = load::<Cpu>(&device).config.vocab_size as i64;
    let b = |seed, bad| batch::<Cpu>(seed, 3, bad, vocab, &device);
    let good = [b(1, false), b(2, false)];
    let (_, reference) = run::<Cpu>(
        "qwen3",
        &[device, device],
        Some(host::<burn::backend::NdArray>(&[device, device])),
        Checkpointing::Off,
        &good,
        2,
    );

    let mut model = load::<Cpu>(&device);
    let before = params(&model);
    let collective = Collective::host(2, Duration::from_secs(60));
    let mut trainer = Trainer::<Cpu>::new(config())
        .unwrap()
        .data_parallel(
            &model,
            &[device, device],
            collective,
            DataParallelOptions::default(),
        )
        .unwrap();
    let (m, out) = trainer.step(model, &[b(1, false), b(2, true)]);
    model = m;
    let err = out.unwrap_err();
    assert!(matches!(err, ModelError::Step { step: 1, .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("worker 1: micro-batch 0, row 1, column 5")
            && text.contains(&format!("label {}", vocab + 3)),
        "{text}"
    );
    assert_eq!(trainer.steps(), 0);
    assert_eq!(params(&model), before, "worker 0's replica changed");
    for _ in 0..2 {
        let (m, out) = trainer.step(model, &good);
        model = m;
        out.unwrap();
    }
    let worst = max_relative_difference(&params(&model), &reference);
    assert!(worst <= 1e-5, "the skipped step left a trace: {worst:e}");
}

/// A worker whose step fails before its share of the sums (rows too short
/// to predict anything) ends the run: the step's error names it within the
/// wait, and every later step returns that error at once.
#[test]
fn a_failing_worker_ends_the_run_with_an_error_naming_it() {
    let device = Default::default();
    let vocab = load::<Cpu>(&device).config.vocab_size as i64;
    let good = batch::<Cpu>(1, 3, false, vocab, &device);
    let one = |v: i64| Tensor::<Cpu, 2, Int>::from_data(TensorData::new(vec![v], [1, 1]), &device);
    let short = MicroBatch {
        ids: one(3),
        labels: one(3),
        positions: None,
    };
    let model = load::<Cpu>(&device);
    let wait = Duration::from_secs(3);
    let mut trainer = Trainer::<Cpu>::new(config())
        .unwrap()
        .data_parallel(
            &model,
            &[device, device],
            Collective::host(2, wait),
            DataParallelOptions { wait },
        )
        .unwrap();
    let started = Instant::now();
    let (model, out) = trainer.step(model, &[good.clone(), short]);
    let err = out.unwrap_err();
    assert!(
        matches!(err, ModelError::Worker { worker: 1, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("at least 2 positions"), "{err}");
    assert!(started.elapsed() < wait * 4, "{:?}", started.elapsed());
    let started = Instant::now();
    let (_, again) = trainer.step(model, &[good.clone(), good]);
    assert_eq!(again.unwrap_err().to_string(), err.to_string());
    assert!(started.elapsed() < Duration::from_secs(1));
}

/// Bad settings are errors before any worker starts.
#[test]
fn data_parallel_settings_are_checked() {
    let device = Default::default();
    let model = load::<Cpu>(&device);
    let attempt = |devices: &[burn::backend::ndarray::NdArrayDevice], workers: usize| {
        Trainer::<Cpu>::new(config())
            .unwrap()
            .data_parallel(
                &model,
                devices,
                Collective::host(workers, Duration::from_secs(1)),
                DataParallelOptions::default(),
            )
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    assert!(attempt(&[], 0).contains("at least one device"));
    let e = attempt(&[device, device], 3);
    assert!(e.contains("for 3 workers, but 2 devices"), "{e}");
    let mut trainer = Trainer::<Cpu>::new(config())
        .unwrap()
        .data_parallel(
            &model,
            &[device, device],
            Collective::host(2, Duration::from_secs(60)),
            DataParallelOptions::default(),
        )
        .unwrap();
    let vocab = model.config.vocab_size as i64;
    let (_, out) = trainer.step(model.clone(), &[batch::<Cpu>(1, 3, false, vocab, &device)]);
    let e = out.unwrap_err().to_string();
    assert!(e.contains("a positive multiple of 2 micro-batches"), "{e}");
}
