//! Trains LoRA adapters on the frozen tiny Qwen3 checkpoint of the test
//! fixtures for a few steps (the loss falls, no base weight changes),
//! saves them in PEFT's format, loads them onto a fresh base and checks
//! that the logits agree, then merges them into the weights.
//!
//! `cargo run -p bastile-models --example lora_tiny [out-dir]`

use bastile_models::lora::parse_targets;
use bastile_models::{CausalLm, LoraConfig, MicroBatch, ModelError, TrainConfig, Trainer};
use burn::backend::{Autodiff, NdArray};
use burn::tensor::{Int, Tensor, TensorData};

// On a GPU: Autodiff<bastile::Bastile<bastile::CudaDirect>> (feature `cuda`;
// a model with experts steps faster on burn::backend::Cuda).
type B = Autodiff<NdArray>;

fn main() -> Result<(), ModelError> {
    let device = Default::default();
    let base = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/qwen3");
    let config = LoraConfig::new(8)
        .with_alpha(16.0)
        .with_targets(parse_targets("q,k,v,o,gate,up,down")?);
    let mut model = CausalLm::<B>::from_hf_dir(base, &device)?.with_lora(config, &device)?;
    let ids: Vec<i64> = (0..16).map(|i| (i * 61 + 7) % 1000).collect();
    let batch = MicroBatch {
        ids: Tensor::<B, 2, Int>::from_data(TensorData::new(ids.clone(), [1, 16]), &device),
        labels: Tensor::<B, 2, Int>::from_data(TensorData::new(ids.clone(), [1, 16]), &device),
        positions: None,
    };
    let steps = 10;
    let mut trainer = Trainer::<B>::new(TrainConfig {
        learning_rate: 1e-2,
        total_steps: steps,
        ..Default::default()
    })?;
    for i in 0..steps {
        let (m, out) = trainer.step(model, std::slice::from_ref(&batch));
        model = m;
        println!("step {i:>2}  loss {:.4}", out?.loss);
    }
    let out = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "target/lora_tiny".into());
    model.save_adapter_dir(&out)?;
    println!("adapters saved to {out} (PeftModel.from_pretrained loads them)");

    let reloaded =
        CausalLm::<B>::from_hf_dir(base, &device)?.load_adapter_dir(&out, None, &device)?;
    let x = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, 16]), &device);
    let trained = model.logits(x.clone())?;
    let difference = (reloaded.logits(x.clone())? - trained.clone()).abs().max();
    println!(
        "reloaded adapters: logits within {}",
        difference.into_scalar()
    );
    let merged = model.merge_lora();
    let difference = (merged.logits(x)? - trained).abs().max();
    println!("merged weights: logits within {}", difference.into_scalar());
    Ok(())
}
