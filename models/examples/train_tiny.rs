//! Loads the tiny Qwen3 checkpoint of the test fixtures, trains it a few
//! AdamW steps on one fixed batch (the loss falls), and saves it back in
//! Hugging Face's format.
//!
//! `cargo run -p bastile-models --example train_tiny [out-dir]`

use bastile_models::{CausalLm, MicroBatch, ModelError, TrainConfig, Trainer};
use burn::backend::{Autodiff, NdArray};
use burn::tensor::{DType, Int, Tensor, TensorData};

// On a GPU: Autodiff<bastile::Bastile<bastile::CudaDirect>> (feature `cuda`;
// a model with experts steps faster on burn::backend::Cuda).
type B = Autodiff<NdArray>;

fn main() -> Result<(), ModelError> {
    let device = Default::default();
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/qwen3");
    let model = CausalLm::<B>::from_hf_dir(dir, &device)?.with_dtype(DType::F32)?;
    let ids: Vec<i64> = (0..16).map(|i| (i * 61 + 7) % 1000).collect();
    let mut labels = ids.clone();
    labels[..4].fill(-100); // a prompt: not trained on
    let batch = MicroBatch {
        ids: Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, 16]), &device),
        labels: Tensor::<B, 2, Int>::from_data(TensorData::new(labels, [1, 16]), &device),
        positions: None,
    };
    let steps = 10;
    let mut trainer = Trainer::<B>::new(TrainConfig {
        learning_rate: 3e-3,
        warmup_steps: 2,
        total_steps: steps,
        ..Default::default()
    })?;
    let mut model = model;
    for i in 0..steps {
        let (m, out) = trainer.step(model, std::slice::from_ref(&batch));
        model = m;
        let out = out?;
        println!(
            "step {i:>2}  loss {:.4}  lr {:.2e}  tokens {}",
            out.loss, out.learning_rate, out.tokens
        );
    }
    let out = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "target/train_tiny".into());
    model.save_hf_dir(&out)?;
    println!("saved to {out}");
    Ok(())
}
