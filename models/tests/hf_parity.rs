//! Parity with HF transformers: tiny random checkpoints written by
//! `fixtures/make_fixtures.py` load through `from_hf_dir`, and the logits,
//! the shifted mean loss and a few parameter gradients match HF's (f32,
//! relative error ≤ 1e-4) — on the baseline (`Autodiff<NdArray>`, composite
//! ops) and under `Autodiff<Bastile<Wgpu>>` (fused kernels) when the wgpu
//! runtime is selected. (Not on CUDA: its f32 matmuls run in TF32, about
//! 1e-3 from f32; the CUDA runs compare bf16 training instead.)
//!
//! The deeper fixtures (four layers, tied embeddings, GQA ratios 4 and 1,
//! head dim 32, three rows of 33 tokens) also carry HF's loss and
//! gradients in float64: each of our gradients must be about as close to
//! them as HF's own f32 gradients are, which tells a difference in the math
//! from f32 rounding in a different order. Every backend is held to that:
//! NdArray, and on the wgpu runtime the composite ops (`Autodiff<Wgpu>`) and
//! the fused kernels. (NdArray is built without its "simd" feature, whose
//! approximate `recip`, which Burn's autodiff takes in the backward pass of
//! `div` and `log`, put its gradients up to 3e-4 from HF's.)

use crate::common::{fixture, reference, values};
use bastile::{BastileBackend, CrossEntropyOptions};
use bastile_cubecl::testing::runtime_selected;
use bastile_models::{CausalLm, MicroBatch, Trainer};
use burn::backend::Autodiff;
use burn::module::ParamId;
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, TensorData};
use burn_store::{BurnToPyTorchAdapter, ModuleSnapshot};

/// HF parity bound: relative L2 error of each tensor.
const TOL: f64 = 1e-4;
/// Per element, relative to `|expected| + rms(expected)`: f32 rounding of
/// reductions in a different order stays far below it, a wrong element
/// does not.
const ELEMENT_TOL: f64 = 1e-3;

fn assert_matches(what: &str, actual: &[f64], expected: &[f64]) {
    assert_eq!(actual.len(), expected.len(), "{what}: length");
    let norm = |v: &mut dyn Iterator<Item = f64>| v.map(|x| x * x).sum::<f64>().sqrt();
    let diff = norm(&mut actual.iter().zip(expected).map(|(a, e)| a - e));
    let rel = diff / norm(&mut expected.iter().copied()).max(f64::MIN_POSITIVE);
    assert!(
        rel <= TOL,
        "{what}: relative L2 error {rel:.3e} (bound {TOL:.0e})"
    );
    let rms = norm(&mut expected.iter().copied()) / (expected.len().max(1) as f64).sqrt();
    for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
        assert!(
            (a - e).abs() <= ELEMENT_TOL * (e.abs() + rms),
            "{what}: element {i} is {a}, expected {e}"
        );
    }
}

/// The gradient of the parameter `id` in HF's layout (`[out, in]` for
/// linear weights).
fn grad_of<B: AutodiffBackend>(
    grads: &GradientsParams,
    id: ParamId,
    rank: usize,
    transpose: bool,
) -> Vec<f64> {
    match rank {
        1 => values(grads.get::<B::InnerBackend, 1>(id).expect("a gradient")),
        2 => {
            let g = grads.get::<B::InnerBackend, 2>(id).expect("a gradient");
            values(if transpose { g.transpose() } else { g })
        }
        3 => values(grads.get::<B::InnerBackend, 3>(id).expect("a gradient")),
        r => panic!("rank {r}"),
    }
}

/// Relative L2 distance of `a` from `b`.
fn relative_l2(a: &[f64], b: &[f64]) -> f64 {
    let norm = |v: &mut dyn Iterator<Item = f64>| v.map(|x| x * x).sum::<f64>().sqrt();
    let diff = norm(&mut a.iter().zip(b).map(|(x, y)| x - y));
    diff / norm(&mut b.iter().copied()).max(f64::MIN_POSITIVE)
}

/// How much farther than HF's own f32 result ours may lie from the float64
/// reference: rounding in a different order stays within a small factor of
/// HF's rounding, a difference in the math does not.
const ROUNDING_FACTOR: f64 = 4.0;
/// Distances below this (relative L2) count as equal whatever HF's were.
const ROUNDING_FLOOR: f64 = 1e-6;

/// The fixture's logits, loss and gradients on `B`, each held to HF's f32
/// result and, where the fixture has one, to the float64 reference.
fn check<B: AutodiffBackend + BastileBackend>(name: &str, backend: &str, device: &B::Device) {
    let what = |x: &str| format!("{name} on {backend}: {x}");
    let r = reference(name);
    let model = CausalLm::<B>::from_hf_dir(fixture(name), device).expect("the fixture loads");
    let ids_of = |key: &str| {
        let (shape, v) = &r[key];
        Tensor::<B, 2, Int>::from_data(
            TensorData::new(
                v.iter().map(|x| *x as i64).collect::<Vec<_>>(),
                [shape[0], shape[1]],
            ),
            device,
        )
    };
    let (ids, labels) = (ids_of("input_ids"), ids_of("labels"));
    let logits = model.logits(ids.clone()).expect("forward");
    assert_matches(&what("logits"), &values(logits), &r["logits"].1);
    let out = model
        .loss(ids, labels, CrossEntropyOptions::default())
        .expect("loss");
    let loss = values(out.loss.clone());
    assert_matches(&what("loss"), &loss, &r["loss"].1);
    let grads = GradientsParams::from_grads(out.loss.backward(), &model);
    let snapshots = model.collect(None, Some(Box::new(BurnToPyTorchAdapter)), true);
    let mut checked = 0;
    for s in snapshots {
        let path = s.full_path();
        let hf = path
            .strip_suffix(".gamma")
            .map_or(path.clone(), |p| format!("{p}.weight"));
        let Some((shape, expected)) = r.get(&format!("grad.{hf}")) else {
            continue;
        };
        // The adapter already reports linear weights in HF's `[out, in]`.
        assert_eq!(s.shape.as_slice(), shape.as_slice(), "{}", what(&hf));
        let transpose = s.module_type().as_deref() == Some("Struct:Linear");
        let id = s.tensor_id.expect("a parameter");
        let got = grad_of::<B>(&grads, id, shape.len(), transpose);
        assert_matches(&what(&format!("grad {hf}")), &got, expected);
        if let Some((_, wide)) = r.get(&format!("grad64.{hf}")) {
            let ours = relative_l2(&got, wide);
            let theirs = relative_l2(expected, wide);
            assert!(
                ours <= ROUNDING_FACTOR * theirs + ROUNDING_FLOOR,
                "{}: {ours:.2e} from float64, HF's f32 {theirs:.2e}",
                what(&format!("grad {hf}"))
            );
        }
        checked += 1;
    }
    if let Some((_, wide)) = r.get("loss64") {
        let ours = relative_l2(&loss, wide);
        let theirs = relative_l2(&r["loss"].1, wide);
        assert!(
            ours <= ROUNDING_FACTOR * theirs + ROUNDING_FLOOR,
            "{}: {ours:.2e} from float64, HF's f32 {theirs:.2e}",
            what("loss")
        );
    }
    let want = r.keys().filter(|k| k.starts_with("grad.")).count();
    assert_eq!(
        checked,
        want,
        "{}",
        what("every reference gradient was checked")
    );
}

/// The fixture on the baseline, then on the wgpu runtime (see [`on_wgpu`]).
fn each_backend(name: &str, composite_on_wgpu: bool) {
    check::<Autodiff<burn::backend::NdArray>>(name, "ndarray (baseline)", &Default::default());
    on_wgpu(name, composite_on_wgpu);
}

/// The fixture under Bastile's fused kernels on the wgpu runtime (first
/// under the composite ops too when `composite`), held to the float64
/// reference where the fixture has one; nothing when wgpu is not selected.
fn on_wgpu(name: &str, composite: bool) {
    if !runtime_selected("wgpu", cfg!(feature = "wgpu")) {
        return;
    }
    #[cfg(feature = "wgpu")]
    {
        if composite {
            check::<Autodiff<burn::backend::Wgpu>>(name, "wgpu (composite)", &Default::default());
        }
        bastile::apply(bastile::Patches::default());
        check::<Autodiff<bastile::Bastile<burn::backend::Wgpu>>>(
            name,
            "wgpu (Bastile)",
            &Default::default(),
        );
    }
    #[cfg(not(feature = "wgpu"))]
    let _ = (name, composite);
}

#[test]
fn qwen3_matches_hf_transformers() {
    each_backend("qwen3", false);
}

#[test]
fn llama_with_llama3_rope_tied_and_sharded_matches_hf_transformers() {
    each_backend("llama", false);
}

#[test]
fn gpt_oss_with_experts_sinks_and_windows_matches_hf_transformers() {
    each_backend("gpt_oss", false);
}

/// GPT-OSS with HF's router load-balancing loss (`output_router_logits`,
/// coefficient 0.5) in the loss and the router gradients.
#[test]
fn gpt_oss_with_the_router_load_balancing_loss_matches_hf_transformers() {
    each_backend("gpt_oss_router_aux", false);
}

/// A deeper fixture on every backend, the composite ops on wgpu included,
/// all held to the float64 reference too (see the module docs).
fn deeper(name: &str) {
    each_backend(name, true);
}

#[test]
fn deeper_llama_tied_with_four_query_heads_per_kv_head_matches_hf_transformers() {
    deeper("deep_llama");
}

#[test]
fn deeper_qwen3_with_one_query_head_per_kv_head_matches_hf_transformers() {
    deeper("deep_qwen3");
}

/// The evaluation loss is HF's mean shifted loss over every counted token,
/// whether the rows come as one batch or one micro-batch each (the mean is
/// over tokens, not batches).
#[test]
fn evaluation_loss_matches_hf_transformers() {
    type B = Autodiff<burn::backend::NdArray>;
    let device = Default::default();
    let r = reference("qwen3");
    let model = CausalLm::<B>::from_hf_dir(fixture("qwen3"), &device).expect("the fixture loads");
    let rows = |key: &str, range: std::ops::Range<usize>| {
        let (shape, v) = &r[key];
        let cols = shape[1];
        let vals: Vec<i64> = v[range.start * cols..range.end * cols]
            .iter()
            .map(|x| *x as i64)
            .collect();
        Tensor::<B, 2, Int>::from_data(TensorData::new(vals, [range.len(), cols]), &device)
    };
    let batch = |range: std::ops::Range<usize>| MicroBatch {
        ids: rows("input_ids", range.clone()),
        labels: rows("labels", range),
        positions: None,
    };
    let whole = Trainer::<B>::evaluate(&model, &[batch(0..2)]).unwrap();
    let split = Trainer::<B>::evaluate(&model, &[batch(0..1), batch(1..2)]).unwrap();
    for (what, got) in [("one batch", whole), ("a batch a row", split)] {
        assert_matches(&format!("evaluation, {what}"), &[got], &r["loss"].1);
    }
}
