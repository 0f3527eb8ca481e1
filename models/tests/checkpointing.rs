//! Activation checkpointing (`bastile_models::checkpointing`): the loss and
//! every parameter's gradient are those of the plain backward pass, with
//! every layer recomputed and with every other layer, on Qwen3 (q/k
//! norms), Llama (tied embeddings), GPT-OSS (experts, sinks, a window),
//! packed rows and LoRA adapters; training with it takes the same steps.
//!
//! On the CPU (`Autodiff<NdArray>`) always, under Bastile on the wgpu and
//! CUDA runtimes when they are selected.

use std::num::NonZeroUsize;
use std::path::PathBuf;

use bastile::{BastileBackend, CrossEntropyOptions, Reduction};
use bastile_cubecl::testing::runtime_selected;
use bastile_models::{CausalLm, Checkpointing, LoraConfig, MicroBatch, ModelError, Trainer};
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, TensorData};

use crate::training::params;

type Cpu = burn::backend::Autodiff<burn::backend::NdArray>;

fn load<B: AutodiffBackend>(name: &str, device: &B::Device) -> CausalLm<B> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name);
    CausalLm::<B>::from_hf_dir(dir, device).unwrap()
}

/// `[2, 11]` ids and labels (the first three labels ignored); with
/// `packed`, row 1 holds two documents (positions restart at column 4).
fn batch<B: AutodiffBackend>(vocab: i64, packed: bool, device: &B::Device) -> MicroBatch<B> {
    let ids: Vec<i64> = (0..22).map(|i| (i * 131 + 7) % vocab).collect();
    let mut labels = ids.clone();
    labels[..3].fill(-100);
    let positions: Vec<i64> = (0..22)
        .map(|i| if i >= 11 + 4 { i - 15 } else { i % 11 })
        .collect();
    let int = |v: Vec<i64>| Tensor::<B, 2, Int>::from_data(TensorData::new(v, [2, 11]), device);
    MicroBatch {
        ids: int(ids),
        labels: int(labels),
        positions: packed.then(|| int(positions)),
    }
}

/// Each parameter's gradient (`None` where it has none), in the model's
/// parameter order.
struct Grads<'a> {
    grads: &'a GradientsParams,
    out: Vec<Option<Vec<f64>>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Grads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let grad = self
            .grads
            .get::<B::InnerBackend, D>(param.id)
            .map(|g| g.into_data().convert::<f64>().to_vec::<f64>().unwrap());
        self.out.push(grad);
    }
}

/// The loss (sum over tokens, divided by 3) and every gradient of one
/// micro-batch with `checkpointing`.
fn loss_and_grads<B>(
    model: &CausalLm<B>,
    batch: &MicroBatch<B>,
    checkpointing: Checkpointing,
) -> (f64, Vec<Option<Vec<f64>>>)
where
    B: AutodiffBackend + BastileBackend,
    B::InnerBackend: BastileBackend,
{
    let model = model.clone().with_checkpointing(checkpointing).unwrap();
    let device = batch.ids.device();
    let options = CrossEntropyOptions::default().with_reduction(Reduction::Sum);
    let (out, grads) = model
        .loss_and_grads(
            batch.ids.clone(),
            batch.labels.clone(),
            batch.positions.clone(),
            options,
            Tensor::from_floats([3.0], &device),
        )
        .unwrap();
    let loss = out.loss.into_scalar().to_string().parse().unwrap();
    let mut visitor = Grads {
        grads: &grads,
        out: Vec::new(),
    };
    model.visit(&mut visitor);
    (loss, visitor.out)
}

/// Checkpointed losses and gradients against the plain backward pass, on
/// every fixture: within `tol`, relative to the loss and to each
/// gradient's largest value.
fn checkpointing_matches_plain_backward<B>(backend: &str, cases: &[Case], tol: f64)
where
    B: AutodiffBackend + BastileBackend,
    B::InnerBackend: BastileBackend,
{
    let device = Default::default();
    let every_other = Checkpointing::Every(NonZeroUsize::new(2).unwrap());
    for &(fixture, packed, lora) in cases {
        let mut model = load::<B>(fixture, &device);
        if lora {
            model = model.with_lora(LoraConfig::new(4), &device).unwrap();
        }
        let batch = batch::<B>(model.config.vocab_size as i64, packed, &device);
        let (plain_loss, plain) = loss_and_grads(&model, &batch, Checkpointing::Off);
        let trained = plain.iter().filter(|g| g.is_some()).count();
        assert!(trained > 0, "{backend} {fixture}: no gradient");
        if lora {
            // Only the adapters train: two per projection.
            assert_eq!(trained, 2 * 7 * model.model.layers.len());
        }
        for checkpointing in [Checkpointing::ALL, every_other] {
            let what =
                format!("{backend} {fixture} (packed {packed}, LoRA {lora}) {checkpointing}");
            let (loss, grads) = loss_and_grads(&model, &batch, checkpointing);
            assert!(
                (loss - plain_loss).abs() <= tol * plain_loss.abs(),
                "{what}: loss {loss} against {plain_loss}"
            );
            assert_eq!(grads.len(), plain.len());
            for (k, (g, p)) in grads.iter().zip(&plain).enumerate() {
                let (g, p) = match (g, p) {
                    (Some(g), Some(p)) => (g, p),
                    (None, None) => continue,
                    _ => panic!("{what}: parameter {k} has a gradient on one side only"),
                };
                let scale = p.iter().fold(1e-12f64, |m, v| m.max(v.abs()));
                let worst = g
                    .iter()
                    .zip(p)
                    .fold(0f64, |m, (a, b)| m.max((a - b).abs() / scale));
                assert!(
                    worst <= tol,
                    "{what}: parameter {k} differs by {worst} of its largest"
                );
            }
        }
    }
}

/// A fixture, whether its rows are packed, whether it has LoRA adapters.
type Case = (&'static str, bool, bool);

/// Qwen3 (q/k norms), Llama (tied embeddings, three layers: one kept
/// between two recomputed), GPT-OSS (experts, sinks, a window), packed
/// rows over four layers, LoRA adapters, GPT-OSS with the router's
/// load-balancing loss (each layer's part joins its backward pass).
const CASES: [Case; 6] = [
    ("qwen3", false, false),
    ("llama", false, false),
    ("gpt_oss", false, false),
    ("deep_qwen3", true, false),
    ("qwen3", false, true),
    ("gpt_oss_router_aux", false, false),
];

#[test]
fn checkpointed_backward_gives_the_plain_gradients() {
    checkpointing_matches_plain_backward::<Cpu>("cpu", &CASES, 1e-5);
    // Under Bastile's kernels: the fused nodes recomputed in their own
    // graphs (software Vulkan is slow; three cases cover them).
    if runtime_selected("wgpu", cfg!(feature = "wgpu")) {
        #[cfg(feature = "wgpu")]
        checkpointing_matches_plain_backward::<
            burn::backend::Autodiff<bastile::Bastile<burn::backend::Wgpu>>,
        >("wgpu", &CASES[1..4], 1e-5);
    }
    #[cfg(feature = "cuda")]
    if runtime_selected("cuda", true) {
        checkpointing_matches_plain_backward::<
            burn::backend::Autodiff<bastile::Bastile<burn::backend::Cuda>>,
        >("cuda", &CASES, 1e-5);
    }
}

/// Three training steps with every layer checkpointed end where three
/// plain steps do (f32, 1e-5 of each tensor's largest value).
#[test]
fn checkpointed_training_takes_the_plain_steps() {
    let device = Default::default();
    let run = |checkpointing| {
        let mut model = load::<Cpu>("llama", &device)
            .with_checkpointing(checkpointing)
            .unwrap();
        let batches = [batch::<Cpu>(model.config.vocab_size as i64, false, &device)];
        let mut trainer = Trainer::<Cpu>::new(crate::training::config()).unwrap();
        let mut losses = Vec::new();
        for _ in 0..3 {
            let (m, out) = trainer.step(model, &batches);
            model = m;
            losses.push(out.unwrap().loss);
        }
        (losses, params(&model))
    };
    let (plain_losses, plain) = run(Checkpointing::Off);
    let (losses, checkpointed) = run(Checkpointing::ALL);
    for (a, b) in losses.iter().zip(&plain_losses) {
        assert!(
            (a - b).abs() <= 1e-5 * b.abs(),
            "losses {losses:?} against {plain_losses:?}"
        );
    }
    for ((path, a), (_, b)) in checkpointed.iter().zip(&plain) {
        let scale = b.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= 1e-5 * scale, "{path}: {x} against {y}");
        }
    }
}

/// LoRA dropout and checkpointing are refused together, in either order.
#[test]
fn checkpointing_with_lora_dropout_is_refused() {
    let device = Default::default();
    let lora = LoraConfig::new(4).with_dropout(0.1);
    let expect_refusal = |result: Result<CausalLm<Cpu>, ModelError>| {
        let message = result.expect_err("refused").to_string();
        assert!(
            message.contains("checkpointing") && message.contains("dropout"),
            "{message}"
        );
    };
    let with_lora = load::<Cpu>("qwen3", &device)
        .with_lora(lora.clone(), &device)
        .unwrap();
    expect_refusal(with_lora.with_checkpointing(Checkpointing::ALL));
    let checkpointed = load::<Cpu>("qwen3", &device)
        .with_checkpointing(Checkpointing::ALL)
        .unwrap();
    expect_refusal(checkpointed.with_lora(lora, &device));
}
