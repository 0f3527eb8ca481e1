//! Trains the tiny Qwen3 checkpoint of the test fixtures data-parallel:
//! one worker per device, each taking its own micro-batch, the gradients
//! summed before every update, and shows that the replicas train as one
//! worker accumulating both micro-batches would.
//!
//! `cargo run -p bastile-models --example data_parallel`: two workers on
//! the CPU, summing on the host.
//!
//! `cargo run --release -p bastile-models --features distributed --example
//! data_parallel`: one worker per CUDA GPU (at least two), summing through
//! NCCL (`libnccl.so` on the library path).

use std::time::Duration;

use bastile_models::{
    CausalLm, Collective, DataParallelOptions, MicroBatch, ModelError, TrainConfig, Trainer,
};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Int, Tensor, TensorData};

fn main() -> Result<(), ModelError> {
    #[cfg(feature = "distributed")]
    {
        use burn::tensor::backend::{Device, DeviceId};
        type B = burn::backend::Autodiff<bastile::Bastile<burn::backend::Cuda>>;
        let count = <B as Backend>::device_count(0);
        if count < 2 {
            return Err(ModelError::Config(format!(
                "data-parallel training over CUDA needs two GPUs; this machine has {count}"
            )));
        }
        let devices: Vec<_> = (0..count)
            .map(|k| Device::from_id(DeviceId::new(0, k as u16)))
            .collect();
        let collective = Collective::nccl(&devices)?;
        train::<B>(&devices, collective)
    }
    #[cfg(not(feature = "distributed"))]
    {
        type B = burn::backend::Autodiff<burn::backend::NdArray>;
        let devices = [Default::default(); 2];
        train::<B>(&devices, Collective::host(2, Duration::from_secs(60)))
    }
}

/// Trains five steps with one worker per device, then the same steps with
/// one worker accumulating every micro-batch, and compares the losses.
fn train<B>(
    devices: &[B::Device],
    collective: Collective<B::InnerBackend>,
) -> Result<(), ModelError>
where
    B: AutodiffBackend + bastile::BastileBackend,
    B::InnerBackend: bastile::BastileBackend,
    CausalLm<B>: Send + 'static,
{
    let device = &devices[0];
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/qwen3");
    let load = || CausalLm::<B>::from_hf_dir(dir, device)?.with_dtype(DType::F32);
    let vocab = load()?.config.vocab_size as i64;
    // One micro-batch per worker (all on the first device: the trainer
    // hands each worker its own).
    let batches: Vec<MicroBatch<B>> = (0..devices.len() as i64)
        .map(|w| {
            let ids: Vec<i64> = (0..16).map(|i| (i * 61 + 7 + w * 131) % vocab).collect();
            let mut labels = ids.clone();
            labels[..4].fill(-100); // a prompt: not trained on
            MicroBatch {
                ids: Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, 16]), device),
                labels: Tensor::<B, 2, Int>::from_data(TensorData::new(labels, [1, 16]), device),
                positions: None,
            }
        })
        .collect();
    let config = TrainConfig {
        learning_rate: 3e-3,
        total_steps: 5,
        ..Default::default()
    };
    let mut model = load()?;
    let mut parallel = Trainer::<B>::new(config.clone())?.data_parallel(
        &model,
        devices,
        collective,
        DataParallelOptions {
            wait: Duration::from_secs(600),
        },
    )?;
    let mut single = Trainer::<B>::new(config)?;
    let mut reference = load()?;
    println!(
        "{} workers on {}",
        parallel.workers(),
        <B as Backend>::name(device)
    );
    for step in 1..=5 {
        let (m, out) = parallel.step(model, &batches);
        model = m;
        let out = out?;
        let (r, expected) = single.step(reference, &batches);
        reference = r;
        let expected = expected?;
        println!(
            "step {step}  data-parallel loss {:.6}  one worker accumulating {:.6}  tokens {}",
            out.loss, expected.loss, out.tokens
        );
    }
    Ok(())
}
