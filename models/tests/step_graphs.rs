//! A trainer with step graphs trains as one without: the tiny Qwen3
//! checkpoint, batches that change from step to step under a warmup
//! schedule (new inputs and a new learning rate at every replay), a step
//! of another shape between replays and a step with a label out of range.
//! On CUDA the third step is recorded and the later ones of its shape are
//! replays; where a step cannot be recorded (wgpu; a model whose
//! parameters another owner holds), training goes on plainly.

use bastile::BastileBackend;
use bastile_cubecl::testing::runtime_selected;
use bastile_models::{CausalLm, MicroBatch, ModelError, TrainConfig, Trainer};
use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, TensorData};

use crate::common::fixture;
use crate::training::params;

const STEPS: usize = 10;
/// The step with a label outside the vocabulary.
const BAD_STEP: usize = 7;
/// The step whose micro-batches have another shape.
const OTHER_SHAPE_STEP: usize = 5;

fn config() -> TrainConfig {
    TrainConfig {
        learning_rate: 3e-3,
        warmup_steps: 4,
        total_steps: STEPS,
        weight_decay: 0.01,
        ..Default::default()
    }
}

/// Step `step`'s two micro-batches.
fn batches<B: AutodiffBackend>(step: usize, vocab: i64, device: &B::Device) -> Vec<MicroBatch<B>> {
    let seq = if step == OTHER_SHAPE_STEP { 9 } else { 12 };
    (0..2)
        .map(|m| {
            let seed = (step * 2 + m) as i64;
            let ids: Vec<i64> = (0..2 * seq as i64)
                .map(|i| (i * 131 + seed * 17) % vocab)
                .collect();
            let mut labels = ids.clone();
            labels[..3].fill(-100);
            if step == BAD_STEP && m == 1 {
                labels[5] = vocab + 3;
            }
            MicroBatch {
                ids: Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [2, seq]), device),
                labels: Tensor::<B, 2, Int>::from_data(TensorData::new(labels, [2, seq]), device),
                positions: None,
            }
        })
        .collect()
}

/// What a run gives: each step's loss (`None` for the failed one), the
/// final parameters, whether the trainer replayed a recorded step at the
/// end, and why it refused to record one.
type Run = (
    Vec<Option<f64>>,
    Vec<(String, Vec<f32>)>,
    bool,
    Option<String>,
);

/// The tiny Qwen3 checkpoint.
fn qwen3<B: AutodiffBackend + BastileBackend>(device: &B::Device) -> CausalLm<B> {
    CausalLm::<B>::from_hf_dir(fixture("qwen3"), device).unwrap()
}

fn train<B>(graphs: bool, keep_a_clone: bool) -> Run
where
    B: AutodiffBackend + BastileBackend,
    B::InnerBackend: BastileBackend,
    CausalLm<B>: AutodiffModule<B>,
{
    let device = Default::default();
    let mut model = qwen3::<B>(&device);
    let vocab = model.config.vocab_size as i64;
    let mut trainer = Trainer::<B>::new(config()).unwrap();
    if graphs {
        trainer = trainer.with_step_graphs().unwrap();
    }
    let mut aside = None;
    let mut losses = Vec::new();
    for step in 0..STEPS {
        if keep_a_clone && step == 2 {
            // Held while the third step, the one recorded, runs.
            aside = Some(model.clone());
        }
        let (m, out) = trainer.step(model, &batches::<B>(step, vocab, &device));
        model = m;
        if step == BAD_STEP {
            match out {
                Err(ModelError::Step { step: n, message }) => {
                    // Steps are numbered from 1, by the steps that applied.
                    assert_eq!(n, BAD_STEP + 1, "{message}");
                    assert!(message.contains("label"), "{message}");
                }
                other => panic!("step {step}: expected a label error, got {other:?}"),
            }
            losses.push(None);
        } else {
            losses.push(Some(out.unwrap().loss));
        }
    }
    drop(aside);
    let refusal = trainer.step_graph_refusal().map(str::to_string);
    (
        losses,
        params(&model),
        trainer.replaying().is_some(),
        refusal,
    )
}

/// `graphed` follows `plain` step by step and ends with the same
/// parameters, within `tol` (relative).
fn same_run(what: &str, plain: &Run, graphed: &Run, tol: f64) {
    eprintln!("{what}: plain {:?}", plain.0);
    eprintln!("{what}: graphs {:?}", graphed.0);
    for (step, (a, b)) in plain.0.iter().zip(&graphed.0).enumerate() {
        match (a, b) {
            (Some(a), Some(b)) => {
                let rel = (a - b).abs() / a.abs();
                assert!(rel <= tol, "{what} step {step}: {b} vs {a} ({rel:.2e})");
            }
            (None, None) => {}
            _ => panic!("{what} step {step}: {b:?} vs {a:?}"),
        }
    }
    let mut worst = 0.0f64;
    for ((path, a), (_, b)) in plain.1.iter().zip(&graphed.1) {
        let diff: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
        let norm: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum();
        let rel = (diff / norm.max(f64::MIN_POSITIVE)).sqrt();
        worst = worst.max(rel);
        assert!(rel <= tol, "{what}: {path} differs by {rel:.2e}");
    }
    eprintln!("{what}: largest parameter difference {worst:.2e}");
}

/// LoRA dropout draws new masks every step, which a replay would repeat:
/// such a model is never recorded.
#[cfg(feature = "wgpu")]
fn lora_dropout_is_not_recorded<B>()
where
    B: AutodiffBackend + BastileBackend,
    B::InnerBackend: BastileBackend,
    CausalLm<B>: AutodiffModule<B>,
{
    let device = Default::default();
    let mut model = qwen3::<B>(&device)
        .with_lora(
            bastile_models::LoraConfig::new(4).with_dropout(0.1),
            &device,
        )
        .unwrap();
    let vocab = model.config.vocab_size as i64;
    let mut trainer = Trainer::<B>::new(config())
        .unwrap()
        .with_step_graphs()
        .unwrap();
    for step in 0..3 {
        let (m, out) = trainer.step(model, &batches::<B>(step, vocab, &device));
        model = m;
        out.unwrap();
    }
    let why = trainer.step_graph_refusal();
    assert!(why.is_some_and(|w| w.contains("dropout")), "{why:?}");
}

#[test]
fn a_trainer_with_step_graphs_trains_as_one_without() {
    let mut ran = false;
    if runtime_selected("wgpu", cfg!(feature = "wgpu")) {
        #[cfg(feature = "wgpu")]
        {
            type B = burn::backend::Autodiff<bastile::Bastile<burn::backend::Wgpu>>;
            bastile::apply(bastile::Patches::default());
            let plain = train::<B>(false, false);
            let graphed = train::<B>(true, false);
            assert!(!graphed.2, "wgpu has no step graphs");
            assert!(
                graphed.3.as_deref().is_some_and(|why| why.contains("CUDA")),
                "{:?}",
                graphed.3
            );
            // The same plain steps: identical.
            same_run("wgpu", &plain, &graphed, 0.0);
            lora_dropout_is_not_recorded::<B>();
            ran = true;
        }
    }
    if runtime_selected("cuda", cfg!(feature = "cuda")) {
        #[cfg(feature = "cuda")]
        {
            type B = burn::backend::Autodiff<bastile::Bastile<bastile::CudaDirect>>;
            bastile::apply(bastile::Patches::default());
            let plain = train::<B>(false, false);
            let graphed = train::<B>(true, false);
            assert!(graphed.2, "the trainer should replay a recorded step");
            // The replays run the plain steps' kernels on the same values:
            // the runs agree up to the order of the kernels' atomic sums.
            same_run("cuda", &plain, &graphed, 1e-5);
            let refused = train::<B>(true, true);
            assert!(
                !refused.2,
                "a parameter held elsewhere is not updated in place"
            );
            assert!(
                refused
                    .3
                    .as_deref()
                    .is_some_and(|why| why.contains("in place")),
                "{:?}",
                refused.3
            );
            same_run("cuda, a clone kept aside", &plain, &refused, 1e-5);
            ran = true;
        }
    }
    assert!(
        ran,
        "no runtime selected: set BASTILE_TEST_RUNTIMES to wgpu and/or cuda"
    );
}
