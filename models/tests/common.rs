//! Helpers the model tests share: the HF fixtures and f64 views of tensors.

use std::collections::HashMap;
use std::path::PathBuf;

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use safetensors::SafeTensors;

/// A tiny HF checkpoint under `models/fixtures/` (`make_fixtures.py`).
pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

/// An f32 tensor holding `values` (row-major).
pub fn tensor<B: Backend, const D: usize>(
    values: &[f64],
    shape: [usize; D],
    device: &B::Device,
) -> Tensor<B, D> {
    let data: Vec<f32> = values.iter().map(|&v| v as f32).collect();
    Tensor::from_data(TensorData::new(data, shape), device)
}

/// A tensor's values as f64 (read as f32, exact for every float dtype the
/// models use).
pub fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f64> {
    t.into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .unwrap()
        .into_iter()
        .map(f64::from)
        .collect()
}

/// A fixture's `reference.safetensors`: name → (shape, values as f64).
pub fn reference(name: &str) -> HashMap<String, (Vec<usize>, Vec<f64>)> {
    let bytes = std::fs::read(fixture(name).join("reference.safetensors")).expect("fixture");
    let st = SafeTensors::deserialize(&bytes).expect("valid fixture");
    st.tensors()
        .into_iter()
        .map(|(k, v)| {
            let data = v.data();
            let vals: Vec<f64> = match v.dtype() {
                safetensors::Dtype::F32 => data
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
                    .collect(),
                safetensors::Dtype::F64 => data
                    .chunks_exact(8)
                    .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
                    .collect(),
                safetensors::Dtype::I64 => data
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f64)
                    .collect(),
                other => panic!("unexpected fixture dtype {other:?}"),
            };
            (k, (v.shape().to_vec(), vals))
        })
        .collect()
}
