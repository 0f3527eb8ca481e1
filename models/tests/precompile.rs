//! The workers that compile a training step's kernels up front: the model
//! and batch they build, and every part of the step running on them.

use std::path::PathBuf;

use bastile_models::precompile::{Part, plain_batch, run_part, worker_batch, worker_config};
use bastile_models::{CausalLm, HfConfig, MicroBatch, TrainConfig};
use burn::tensor::{DType, Int, Tensor, TensorData};

type B = burn::backend::Autodiff<burn::backend::NdArray>;

fn fixture_config(name: &str) -> HfConfig {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name);
    HfConfig::from_file(&dir.join("config.json")).unwrap()
}

fn ints(values: Vec<i64>, rows: usize) -> Tensor<B, 2, Int> {
    let cols = values.len() / rows;
    Tensor::from_data(TensorData::new(values, [rows, cols]), &Default::default())
}

#[test]
fn a_worker_model_keeps_the_first_layer_and_what_its_part_runs() {
    let mut config = fixture_config("gpt_oss");
    config.num_hidden_layers = 6;
    let kinds = ["sliding_attention", "full_attention"];
    config.layer_types = Some((0..6).map(|i| kinds[i % 2].to_string()).collect());
    for part in Part::ALL {
        let worker = worker_config(&config, part);
        // A worker's config is its own worker config (the command builds a
        // worker's model first and hands its config to `run_part`).
        assert_eq!(
            serde_json::to_value(worker_config(&worker, part)).unwrap(),
            serde_json::to_value(&worker).unwrap()
        );
        assert_eq!(worker.num_hidden_layers, 1);
        assert_eq!(worker.layer_types, Some(vec![kinds[0].to_string()]));
        let resolved = worker.resolve().unwrap();
        assert_eq!(resolved.windows, vec![config.sliding_window.or(Some(128))]);
        // The attention and the hidden size are the model's own.
        let model = config.resolve().unwrap();
        assert_eq!(
            (
                resolved.hidden_size,
                resolved.heads,
                resolved.kv_heads,
                resolved.head_dim
            ),
            (
                model.hidden_size,
                model.heads,
                model.kv_heads,
                model.head_dim
            )
        );
        assert_eq!(resolved.attention_sinks, model.attention_sinks);
        assert_eq!(
            resolved.moe.map(|m| m.experts),
            model.moe.map(|m| m.experts)
        );
        // The MLP only where the part runs it; never the full vocabulary.
        let mlp = if part == Part::Mlp {
            model.intermediate_size
        } else {
            64
        };
        assert_eq!(resolved.intermediate_size, mlp, "{part:?}");
        assert_eq!(resolved.vocab_size, 8192);
    }
}

#[test]
fn a_worker_batch_is_the_batch_cut_to_its_first_positions() {
    let (rows, len) = (2, 700);
    let ids: Vec<i64> = (0..(rows * len) as i64).map(|i| i % 97).collect();
    let labels: Vec<i64> = ids.iter().map(|i| (i * 7) % 97).collect();
    let positions: Vec<i64> = (0..(rows * len) as i64)
        .map(|i| (i % len as i64) % 300)
        .collect();
    let batch = MicroBatch::<B> {
        ids: ints(ids.clone(), rows),
        labels: ints(labels.clone(), rows),
        positions: Some(ints(positions.clone(), rows)),
    };
    let cut = worker_batch(&batch);
    let keep = 512;
    let expect = |all: &[i64]| -> Vec<i64> {
        all.chunks(len)
            .flat_map(|row| row[..keep].to_vec())
            .collect()
    };
    let read = |t: Tensor<B, 2, Int>| t.into_data().convert::<i64>().to_vec::<i64>().unwrap();
    assert_eq!(cut.ids.dims(), [rows, keep]);
    assert_eq!(read(cut.ids), expect(&ids));
    assert_eq!(read(cut.labels), expect(&labels));
    assert_eq!(read(cut.positions.unwrap()), expect(&positions));

    // Shorter rows stay whole.
    let short = MicroBatch::<B> {
        ids: ints(vec![3, 1, 4, 1], 1),
        labels: ints(vec![1, 4, 1, 5], 1),
        positions: None,
    };
    let cut = worker_batch(&short);
    assert_eq!(read(cut.ids), vec![3, 1, 4, 1]);
    assert!(cut.positions.is_none());

    // Without data: token 0, rows cut alike.
    let plain = plain_batch::<B>(3, 4096, &Default::default());
    assert_eq!(plain.ids.dims(), [3, keep]);
    assert_eq!(read(plain.ids), vec![0; 3 * keep]);
    assert_eq!(read(plain.labels), vec![0; 3 * keep]);
    assert!(plain.positions.is_none());
}

#[test]
fn every_part_runs_on_every_architecture() {
    let device = Default::default();
    for name in ["qwen3", "llama", "gpt_oss", "gpt_oss_router_aux"] {
        let config = fixture_config(name);
        for part in Part::ALL {
            for packed in [false, true] {
                let batch = MicroBatch::<B> {
                    ids: ints(vec![3, 1, 4, 1, 9000, 9, 2, 6], 1),
                    labels: ints(vec![-100, 1, 4, 1, 9000, 9, 2, 6], 1),
                    positions: packed.then(|| ints(vec![0, 1, 2, 0, 1, 2, 3, 4], 1)),
                };
                let build = |c: &HfConfig| CausalLm::<B>::init(c, &device);
                run_part(
                    part,
                    &config,
                    DType::F32,
                    build,
                    batch,
                    TrainConfig::default(),
                )
                .unwrap_or_else(|e| panic!("{name}, {part:?}, packed {packed}: {e}"));
            }
        }
    }
}
