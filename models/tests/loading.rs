//! Checkpoint loading and saving: round trip through `save_hf_dir`, and a
//! descriptive error (never a panic) for every kind of bad input.

use std::path::{Path, PathBuf};

use crate::common::fixture;
use bastile_models::{CausalLm, HfConfig, ModelError, presets};
use burn::backend::NdArray;
use burn::tensor::{Int, Tensor, TensorData};
use burn_store::ModuleSnapshot;
use safetensors::SafeTensors;

type B = NdArray;

/// A fresh scratch directory under the target dir.
fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Copies fixture `name`'s config and weights into `dir`.
fn copy_fixture(name: &str, dir: &Path) {
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture(name).join(f), dir.join(f)).unwrap();
    }
}

/// Rewrites `dir/model.safetensors` through `edit` (name, dtype, shape, bytes).
fn edit_weights(dir: &Path, edit: impl Fn(&mut Vec<(String, Vec<usize>, Vec<u8>)>)) {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(k, v)| (k, v.shape().to_vec(), v.data().to_vec()))
        .collect();
    edit(&mut tensors);
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(k, s, d)| {
            let v = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), d)
                .unwrap();
            (k.clone(), v)
        })
        .collect();
    let out = safetensors::serialize(views, None).unwrap();
    std::fs::write(dir.join("model.safetensors"), out).unwrap();
}

fn load_err(dir: &Path) -> String {
    match CausalLm::<B>::from_hf_dir(dir, &Default::default()) {
        Ok(_) => panic!("{} loaded but should not", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn ids() -> Tensor<B, 2, Int> {
    Tensor::from_data(
        TensorData::new(
            (0..14).map(|i| (i * 37 % 1000) as i64).collect::<Vec<_>>(),
            [2, 7],
        ),
        &Default::default(),
    )
}

#[test]
fn saved_checkpoint_loads_back_identically() {
    for name in ["qwen3", "llama", "gpt_oss"] {
        let model = CausalLm::<B>::from_hf_dir(fixture(name), &Default::default()).unwrap();
        let dir = scratch(&format!("roundtrip-{name}"));
        model.save_hf_dir(&dir).unwrap();
        // A second save (periodic checkpoints) replaces the first.
        model.save_hf_dir(&dir).unwrap();
        let back = CausalLm::<B>::from_hf_dir(&dir, &Default::default()).unwrap();
        // Every parameter comes back bit for bit, under the same path.
        let params = |m: &CausalLm<B>| {
            m.collect(None, None, true)
                .into_iter()
                .map(|s| (s.full_path(), s.to_data().unwrap()))
                .collect::<Vec<_>>()
        };
        let (before, after) = (params(&model), params(&back));
        assert_eq!(before.len(), after.len(), "{name}: parameter count");
        for ((pa, a), (pb, b)) in before.iter().zip(&after) {
            assert_eq!(pa, pb, "{name}: parameter order");
            assert_eq!(a, b, "{name}: {pa} after a save/load round trip");
        }
        // The logits then agree up to f32 summation order (NdArray's
        // vectorized reductions vary with buffer alignment, run to run).
        let a = model.logits(ids()).unwrap();
        let b = back.logits(ids()).unwrap();
        let diff = (a.clone() - b).abs().max().into_scalar();
        let scale = a.abs().max().into_scalar();
        assert!(
            diff <= 1e-5 * scale,
            "{name}: logits differ by {diff} after a save/load round trip"
        );
        // HF's names and layout: every tensor of the original file, same shape.
        let orig = std::fs::read(fixture(name).join("parameters.json")).unwrap();
        let orig: serde_json::Value = serde_json::from_slice(&orig).unwrap();
        let saved = std::fs::read(dir.join("model.safetensors")).unwrap();
        let saved = SafeTensors::deserialize(&saved).unwrap();
        let shapes = orig["shapes"].as_object().unwrap();
        let tied = model.lm_head.is_none();
        for (k, shape) in shapes {
            if tied && k == "lm_head.weight" {
                continue;
            }
            let t = saved
                .tensor(k)
                .unwrap_or_else(|_| panic!("{name}: {k} not saved"));
            let want: Vec<usize> = serde_json::from_value(shape.clone()).unwrap();
            assert_eq!(t.shape(), want.as_slice(), "{name}: {k}");
        }
        let config = HfConfig::from_file(&dir.join("config.json")).unwrap();
        assert_eq!(config.resolve().unwrap(), model.config, "{name}: config");
    }
}

#[test]
fn missing_files_are_named() {
    let dir = scratch("missing");
    assert!(load_err(&dir).contains("config.json"), "{}", load_err(&dir));
    std::fs::copy(
        fixture("qwen3").join("config.json"),
        dir.join("config.json"),
    )
    .unwrap();
    let e = load_err(&dir);
    assert!(e.contains("model.safetensors"), "{e}");
}

#[test]
fn corrupt_header_is_an_error() {
    let dir = scratch("corrupt");
    copy_fixture("qwen3", &dir);
    let mut bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    bytes[8..16].copy_from_slice(b"garbage!");
    std::fs::write(dir.join("model.safetensors"), &bytes).unwrap();
    let e = load_err(&dir);
    assert!(e.contains("corrupt safetensors header"), "{e}");
    std::fs::write(dir.join("model.safetensors"), &bytes[..5]).unwrap();
    let e = load_err(&dir);
    assert!(e.contains("too short"), "{e}");
}

#[test]
fn unsupported_or_invalid_configs_are_errors() {
    let dir = scratch("config");
    copy_fixture("qwen3", &dir);
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        text.replace("\"qwen3\"", "\"mamba\""),
    )
    .unwrap();
    let e = load_err(&dir);
    assert!(e.contains("unsupported model_type `mamba`"), "{e}");
    std::fs::write(dir.join("config.json"), "{ not json").unwrap();
    let e = load_err(&dir);
    assert!(e.contains("invalid JSON"), "{e}");
    std::fs::write(
        dir.join("config.json"),
        text.replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3"),
    )
    .unwrap();
    let e = load_err(&dir);
    assert!(e.contains("multiple of num_key_value_heads"), "{e}");
    assert!(presets::preset("qwen3-99b").is_err());
}

#[test]
fn config_and_weights_disagreeing_name_the_tensor_and_both_shapes() {
    let dir = scratch("shape");
    copy_fixture("qwen3", &dir);
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        text.replace("\"intermediate_size\": 128", "\"intermediate_size\": 96"),
    )
    .unwrap();
    let e = load_err(&dir);
    assert!(
        e.contains("model.layers.0.mlp.gate_proj.weight")
            && e.contains("[128, 64]")
            && e.contains("[96, 64]"),
        "{e}"
    );
}

#[test]
fn missing_and_unexpected_tensors_are_all_named() {
    let dir = scratch("keys");
    copy_fixture("qwen3", &dir);
    edit_weights(&dir, |t| {
        t.retain(|(k, _, _)| {
            k != "model.layers.1.self_attn.k_norm.weight" && k != "lm_head.weight"
        });
        t.push(("model.layers.0.extra.weight".into(), vec![2], vec![0; 8]));
    });
    let e = load_err(&dir);
    assert!(e.contains("missing tensors"), "{e}");
    assert!(e.contains("model.layers.1.self_attn.k_norm"), "{e}");
    assert!(e.contains("lm_head.weight"), "{e}");
    assert!(
        e.contains("unexpected tensors: model.layers.0.extra.weight"),
        "{e}"
    );
}

#[test]
fn presets_resolve_to_the_published_shapes() {
    for name in presets::NAMES {
        let c = presets::preset(name).unwrap().resolve().unwrap();
        assert_eq!(c.heads % c.kv_heads, 0, "{name}");
    }
    let q = presets::preset("Qwen3-0.6B").unwrap().resolve().unwrap();
    assert_eq!(
        (q.hidden_size, q.layers, q.head_dim, q.vocab_size),
        (1024, 28, 128, 151936)
    );
    assert!(q.qk_norm && q.tie_word_embeddings);
    let g = presets::preset("gpt-oss-20b").unwrap().resolve().unwrap();
    assert_eq!(g.moe.unwrap().experts, 32);
    assert_eq!(g.windows[0], Some(128));
    assert_eq!(g.windows[1], None);
}

#[test]
fn errors_are_typed() {
    let e = CausalLm::<B>::from_hf_dir("/nonexistent/bastile", &Default::default()).unwrap_err();
    assert!(matches!(e, ModelError::Io { .. }), "{e:?}");
}

/// GPT-OSS configs that disagree with themselves or with the expert
/// weights are descriptive errors: a top-k above the expert count, and an
/// expert count the checkpoint's expert tensors do not have (each tensor
/// named with both shapes).
#[test]
fn gpt_oss_expert_settings_are_checked() {
    let dir = scratch("gpt_oss_experts");
    copy_fixture("gpt_oss", &dir);
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        text.replace("\"num_experts_per_tok\": 2", "\"num_experts_per_tok\": 5"),
    )
    .unwrap();
    let e = load_err(&dir);
    assert!(
        e.contains("GPT-OSS needs 1 <= num_experts_per_tok (5) <= num_local_experts (4)"),
        "{e}"
    );
    std::fs::write(
        dir.join("config.json"),
        text.replace("\"num_local_experts\": 4", "\"num_local_experts\": 3"),
    )
    .unwrap();
    let e = load_err(&dir);
    for (tensor, found, expected) in [
        (
            "model.layers.0.mlp.experts.gate_up_proj",
            "[4, 64, 64]",
            "[3, 64, 64]",
        ),
        (
            "model.layers.1.mlp.experts.down_proj",
            "[4, 32, 64]",
            "[3, 32, 64]",
        ),
        ("model.layers.1.mlp.router.bias", "[4]", "[3]"),
    ] {
        // The tensor's own entry: from its name to the end of its shapes.
        let at = e
            .find(&format!("\"{tensor}\""))
            .unwrap_or_else(|| panic!("{tensor} not named: {e}"));
        let entry = &e[at..];
        let entry = &entry[..entry.find("} }").map_or(entry.len(), |end| end + 3)];
        assert!(
            entry.contains(found) && entry.contains(expected),
            "{tensor}: {entry}"
        );
    }
}
