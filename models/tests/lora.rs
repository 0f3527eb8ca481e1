//! LoRA: a projection with an adapter, and GPT-OSS's expert adapters in
//! PEFT's stacked layout, against an f64 reference (values and gradients
//! of the input and both adapter matrices; the frozen base gets none), on
//! NdArray, wgpu (composite and fused) and CUDA when selected; a model with
//! adapters trains only them; merged weights give the adapted logits;
//! adapters saved in PEFT's format load back identically; adapters written
//! by PEFT (`fixtures/make_lora_fixtures.py`, GPT-OSS's router and experts
//! included) give PEFT's logits; bad configs and adapters that do not fit
//! are descriptive errors.

use std::path::{Path, PathBuf};

use crate::common::{fixture, tensor, values};
use bastile::BastileBackend;
use bastile_cubecl::reference::lora as reference;
use bastile_cubecl::testing::{Rng, rel_l2, runtime_selected};
use bastile_models::lora::{ExpertAdapter, LoraAdapter, parse_targets, project};
use bastile_models::moe::ExpertRouting;
use bastile_models::{CausalLm, LoraConfig, LoraTarget, MicroBatch, TrainConfig, Trainer};
use burn::backend::{Autodiff, NdArray};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::nn::Linear;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor, TensorData};
use safetensors::SafeTensors;

type Nd = Autodiff<NdArray>;

/// Replaces every float parameter by normal values of its shape (standard
/// deviation `std`, from a fixed seed: the same on every backend), keeping
/// its id and whether it trains.
struct Fill {
    rng: Rng,
    std: f64,
}

impl<B: Backend> ModuleMapper<B> for Fill {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, t, mapper) = param.consume();
        let trains = t.is_require_grad();
        let shape = t.dims();
        let v = self.rng.normals(shape.iter().product(), 0.0, self.std);
        let t = tensor::<B, D>(&v, shape, &t.device()).cast(t.dtype());
        Param::from_mapped_value(id, if trains { t.require_grad() } else { t }, mapper)
    }
}

/// Gives every adapter of `model` non-zero deterministic values (a fresh
/// `B` is zero, which would hide a wrong update).
fn fill_adapters<B: Backend>(mut model: CausalLm<B>) -> CausalLm<B> {
    let mut fill = Fill {
        rng: Rng::from_seed(100),
        std: 0.1,
    };
    for layer in &mut model.model.layers {
        layer.lora = layer.lora.take().map(|l| l.map(&mut fill));
    }
    model
}

/// One projection with an adapter, odd sizes, against the f64 reference
/// within `tol` (relative L2).
fn projection_matches_reference<B: AutodiffBackend + BastileBackend>(what: &str, tol: f64) {
    let device = Default::default();
    let (batch, seq, i, r, o) = (2, 5, 13, 3, 9);
    let n = batch * seq;
    let mut rng = Rng::from_seed(1);
    let mut normals = |n| rng.normals(n, 0.0, 0.5);
    let (x, w, bias, a, b, g) = (
        normals(n * i),
        normals(i * o),
        normals(o),
        normals(i * r),
        normals(r * o),
        normals(n * o),
    );
    let config = LoraConfig::new(r).with_alpha(7.0).with_rslora(true);
    let s = config.scale();
    assert!((s - 7.0 / 3f64.sqrt()).abs() < 1e-12);
    let base = Linear::<B> {
        weight: Param::from_tensor(tensor(&w, [i, o], &device)),
        bias: Some(Param::from_tensor(tensor(&bias, [o], &device))),
    }
    .no_grad();
    let mut adapter = LoraAdapter::<B>::new(i, o, &config, "projection", &device);
    adapter.lora_a.weight = Param::from_tensor(tensor(&a, [i, r], &device));
    adapter.lora_b.weight = Param::from_tensor(tensor(&b, [r, o], &device));
    let xt = tensor::<B, 3>(&x, [batch, seq, i], &device).require_grad();
    let y = project(&base, Some(&adapter), xt.clone()).unwrap();
    let loss = (y.clone() * tensor::<B, 3>(&g, [batch, seq, o], &device)).sum();
    let grads = loss.backward();
    let problem = reference::Problem {
        sizes: [n, i, r, o],
        x: &x,
        w: &w,
        bias: &bias,
        a: &a,
        b: &b,
        scale: s,
    };
    let got = [
        values(y),
        values(xt.grad(&grads).unwrap()),
        values(adapter.lora_a.weight.val().grad(&grads).unwrap()),
        values(adapter.lora_b.weight.val().grad(&grads).unwrap()),
    ];
    let expected = reference::forward_backward(&problem, &g);
    assert_update_matches(what, &got, &expected, tol);
    assert!(
        base.weight.val().grad(&grads).is_none(),
        "{what}: the frozen base weight got a gradient"
    );
    assert!(base.bias.as_ref().unwrap().val().grad(&grads).is_none());
}

/// An adapter's output and the gradients of its input, `A` and `B`, each
/// within `tol` (relative L2) of the reference's.
fn assert_update_matches(what: &str, got: &[Vec<f64>; 4], expected: &[Vec<f64>; 4], tol: f64) {
    for ((name, got), expected) in ["output", "dx", "dA", "dB"].iter().zip(got).zip(expected) {
        let rel = rel_l2(got, expected);
        assert!(
            rel <= tol,
            "{what}: {name} differs by {rel:.2e} (relative L2)"
        );
    }
}

#[test]
fn lora_projection_matches_f64_reference() {
    projection_matches_reference::<Nd>("ndarray", 1e-5);
    if runtime_selected("wgpu", cfg!(feature = "wgpu")) {
        #[cfg(feature = "wgpu")]
        {
            use burn::backend::Wgpu;
            bastile::apply(bastile::Patches::default());
            projection_matches_reference::<Autodiff<Wgpu>>("wgpu composite", 1e-5);
            projection_matches_reference::<Autodiff<bastile::Bastile<Wgpu>>>("wgpu fused", 1e-5);
        }
    }
    if runtime_selected("cuda", cfg!(feature = "cuda")) {
        #[cfg(feature = "cuda")]
        {
            // f32 products run in TF32 on CUDA (10-bit mantissas): about
            // 1e-3 from f64; a wrong term would be off by its whole size.
            use burn::backend::Cuda;
            bastile::apply(bastile::Patches::default());
            projection_matches_reference::<Autodiff<bastile::Bastile<Cuda>>>("cuda fused", 5e-3);
        }
    }
}

/// Expert adapters in PEFT's layout against an f64 reference: each
/// expert's update `s·(x_e·A_e)·B_e` and the gradients of its input and of
/// both stacked factors, with `A_e`'s column `j` read from `lora_A`'s row
/// `e·rank + j` and `B_e`'s row `j` from `lora_B`'s column `j·experts + e`,
/// as PEFT stores them.
fn expert_adapter_matches_reference<B: AutodiffBackend + BastileBackend>(what: &str, tol: f64) {
    let device = Default::default();
    let (e, n, i, r, o) = (3, 5, 7, 2, 4);
    let mut rng = Rng::from_seed(3);
    let mut normals = |k| rng.normals(k, 0.0, 0.5);
    let (x, a, b, g) = (
        normals(e * n * i),
        normals(e * r * i),
        normals(o * r * e),
        normals(e * n * o),
    );
    let config = LoraConfig::new(r).with_alpha(5.0);
    let s = config.scale();
    let mut adapter = ExpertAdapter::<B>::new(e, i, o, &config, "experts", &device);
    adapter.lora_a.weight = Param::from_tensor(tensor(&a, [e * r, i], &device));
    adapter.lora_b.weight = Param::from_tensor(tensor(&b, [o, r * e], &device));
    let xt = tensor::<B, 3>(&x, [e, n, i], &device).require_grad();
    let y = adapter.update(xt.clone());
    let loss = (y.clone() * tensor::<B, 3>(&g, [e, n, o], &device)).sum();
    let grads = loss.backward();

    let (a_at, b_at) = (
        |ex: usize, j: usize| (ex * r + j) * i,
        |ex: usize, j: usize, oo: usize| oo * r * e + j * e + ex,
    );
    let (mut ey, mut edx, mut eda, mut edb) = (
        vec![0.0; e * n * o],
        vec![0.0; e * n * i],
        vec![0.0; e * r * i],
        vec![0.0; o * r * e],
    );
    for ex in 0..e {
        for m in 0..n {
            let row = (ex * n + m) * i;
            for j in 0..r {
                let xa: f64 = (0..i).map(|ii| x[row + ii] * a[a_at(ex, j) + ii]).sum();
                for oo in 0..o {
                    let (bv, gy) = (b[b_at(ex, j, oo)], g[(ex * n + m) * o + oo]);
                    ey[(ex * n + m) * o + oo] += s * xa * bv;
                    edb[b_at(ex, j, oo)] += s * xa * gy;
                    for ii in 0..i {
                        eda[a_at(ex, j) + ii] += s * gy * bv * x[row + ii];
                        edx[row + ii] += s * gy * bv * a[a_at(ex, j) + ii];
                    }
                }
            }
        }
    }
    let got = [
        values(y),
        values(xt.grad(&grads).unwrap()),
        values(adapter.lora_a.weight.val().grad(&grads).unwrap()),
        values(adapter.lora_b.weight.val().grad(&grads).unwrap()),
    ];
    let expected = [ey, edx, eda, edb];
    assert_update_matches(&format!("{what}: expert adapter"), &got, &expected, tol);
    // Merging adds each expert's `s·A_e·B_e`: its product with `x` is the
    // update.
    let delta = values(adapter.delta_weight());
    let merged: Vec<f64> = (0..e * n * o)
        .map(|k| {
            let (ex, m, oo) = (k / (n * o), k / o % n, k % o);
            (0..i)
                .map(|ii| x[(ex * n + m) * i + ii] * delta[(ex * i + ii) * o + oo])
                .sum()
        })
        .collect();
    let rel = rel_l2(&merged, &got[0]);
    assert!(
        rel <= tol,
        "{what}: merged expert weights differ by {rel:.2e}"
    );
}

#[test]
fn expert_adapters_match_f64_reference() {
    expert_adapter_matches_reference::<Nd>("ndarray", 1e-5);
    if runtime_selected("wgpu", cfg!(feature = "wgpu")) {
        #[cfg(feature = "wgpu")]
        {
            use burn::backend::Wgpu;
            bastile::apply(bastile::Patches::default());
            expert_adapter_matches_reference::<Autodiff<bastile::Bastile<Wgpu>>>(
                "wgpu fused",
                1e-5,
            );
        }
    }
    if runtime_selected("cuda", cfg!(feature = "cuda")) {
        #[cfg(feature = "cuda")]
        {
            // TF32 products, as above.
            use burn::backend::Cuda;
            bastile::apply(bastile::Patches::default());
            expert_adapter_matches_reference::<Autodiff<bastile::Bastile<Cuda>>>(
                "cuda fused",
                5e-3,
            );
        }
    }
}

/// Every float parameter's values, in module order.
struct Values(Vec<Vec<f64>>);

impl<B: Backend> ModuleVisitor<B> for Values {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        self.0.push(values(param.val()));
    }
}

/// Every float parameter's id, in module order.
struct Ids(Vec<ParamId>);

impl<B: Backend> ModuleVisitor<B> for Ids {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        self.0.push(param.id);
    }
}

/// The ids of every layer's adapters.
fn adapter_ids<B: Backend>(model: &CausalLm<B>) -> Vec<ParamId> {
    let mut ids = Ids(Vec::new());
    for layer in &model.model.layers {
        layer.lora.as_ref().unwrap().visit(&mut ids);
    }
    ids.0
}

fn params<B: Backend, M: Module<B>>(m: &M) -> Vec<Vec<f64>> {
    let mut v = Values(Vec::new());
    m.visit(&mut v);
    v.0
}

fn ids<B: Backend>(model: &CausalLm<B>, rows: usize, seq: usize) -> Tensor<B, 2, Int> {
    let vocab = model.config.vocab_size as i64;
    let v: Vec<i64> = (0..(rows * seq) as i64)
        .map(|i| (i * 37 + 11) % vocab)
        .collect();
    Tensor::from_data(TensorData::new(v, [rows, seq]), &Default::default())
}

/// A model with adapters trains only them: one step of the fused AdamW
/// moves every adapter and no base parameter, and the base parameters are
/// frozen (no gradient).
#[test]
fn lora_model_trains_only_its_adapters() {
    trains_only_its_adapters("qwen3");
    // The router's and the experts' adapters too.
    trains_only_its_adapters("gpt_oss");
}

fn trains_only_its_adapters(name: &str) {
    let device = Default::default();
    let base = CausalLm::<Nd>::from_hf_dir(fixture(name), &device).unwrap();
    let before = params(&base);
    let model = fill_adapters(base.with_lora(LoraConfig::new(4), &device).unwrap());
    let adapters_before: Vec<_> = model
        .model
        .layers
        .iter()
        .map(|l| params(l.lora.as_ref().unwrap()))
        .collect();
    let mut trainer = Trainer::new(TrainConfig {
        learning_rate: 1e-2,
        total_steps: 4,
        ..TrainConfig::default()
    })
    .unwrap();
    let x = ids(&model, 2, 9);
    let batch = MicroBatch {
        ids: x.clone(),
        labels: x,
        positions: None,
    };
    let (model, out) = trainer.step(model, &[batch]);
    out.unwrap();
    for (layer, old) in model.model.layers.iter().zip(&adapters_before) {
        for (new, old) in params(layer.lora.as_ref().unwrap()).iter().zip(old) {
            assert_ne!(new, old, "{name}: an adapter did not train");
        }
    }
    let merged_free = {
        let mut m = model;
        for layer in &mut m.model.layers {
            layer.lora = None;
        }
        m
    };
    assert_eq!(
        params(&merged_free),
        before,
        "{name}: a frozen base parameter changed"
    );
}

/// Logits of `ids` `[2, 11]` from a reference file, and the model's.
fn logits<B: BastileBackend>(model: &CausalLm<B>, ids: Tensor<B, 2, Int>) -> Vec<f64> {
    values(model.logits(ids).unwrap())
}

/// Merged weights give base + adapters' logits; the merged model has no
/// adapters left. GPT-OSS's adapted experts give the same logits run
/// densely and routed.
#[test]
fn merged_lora_gives_the_adapted_logits() {
    type B = NdArray;
    let device = Default::default();
    for name in ["qwen3", "llama", "gpt_oss"] {
        let base = CausalLm::<B>::from_hf_dir(fixture(name), &device).unwrap();
        let plain = logits(&base, ids(&base, 2, 7));
        let adapted = fill_adapters(
            base.with_lora(LoraConfig::new(3).with_alpha(6.0), &device)
                .unwrap(),
        );
        let x = ids(&adapted, 2, 7);
        let with_adapters = logits(&adapted, x.clone());
        let adapted = if adapted.config.moe.is_some() {
            // `with_adapters` ran the experts routed (the default).
            let dense = adapted.with_expert_routing(ExpertRouting::Dense).unwrap();
            let rel = rel_l2(&logits(&dense, x.clone()), &with_adapters);
            assert!(rel <= 1e-5, "{name}: routed experts differ by {rel:.2e}");
            dense.with_expert_routing(ExpertRouting::Routed).unwrap()
        } else {
            adapted
        };
        let merged = adapted.merge_lora();
        assert!(merged.lora_config().is_none());
        assert!(merged.model.layers.iter().all(|l| l.lora.is_none()));
        let merged_logits = logits(&merged, x);
        let moved = rel_l2(&with_adapters, &plain);
        assert!(
            moved > 1e-2,
            "{name}: the adapters barely move the logits ({moved:.1e})"
        );
        let rel = rel_l2(&merged_logits, &with_adapters);
        assert!(rel <= 1e-5, "{name}: merged logits differ by {rel:.2e}");
    }
}

/// A temporary directory removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("bastile-lora-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Saved in PEFT's format and loaded onto the base again: the same adapter
/// values and logits, a config PEFT reads, PEFT's tensor names and layout.
#[test]
fn lora_adapters_save_and_load_back() {
    type B = NdArray;
    let device = Default::default();
    let config = LoraConfig::new(3)
        .with_alpha(5.0)
        .with_rslora(true)
        .with_targets(parse_targets("q,v,down").unwrap());
    let base = || CausalLm::<B>::from_hf_dir(fixture("qwen3"), &device).unwrap();
    let model = fill_adapters(base().with_lora(config.clone(), &device).unwrap());
    let dir = TempDir::new("roundtrip");
    model.save_adapter_dir(&dir.0).unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.0.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(json["peft_type"], "LORA");
    assert_eq!(json["r"], 3);
    assert_eq!(json["lora_alpha"], 5.0);
    assert_eq!(json["use_rslora"], true);
    assert_eq!(json["rank_pattern"], serde_json::json!({}));
    assert_eq!(
        json["target_modules"],
        serde_json::json!(["q_proj", "v_proj", "down_proj"])
    );
    let bytes = std::fs::read(dir.0.join("adapter_model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
    names.sort();
    assert_eq!(names.len(), 2 * 3 * 2, "{names:?}");
    let a = st
        .tensor("base_model.model.model.layers.1.mlp.down_proj.lora_A.weight")
        .unwrap();
    assert_eq!(a.shape(), [3, model.config.intermediate_size]);
    let b = st
        .tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight")
        .unwrap();
    assert_eq!(b.shape(), [model.config.heads * model.config.head_dim, 3]);

    let loaded = base().load_adapter_dir(&dir.0, None, &device).unwrap();
    assert_eq!(loaded.lora_config(), Some(&config));
    // The adapters get the same ids in every model (an optimizer state
    // saved beside them applies to them again).
    assert_eq!(adapter_ids(&loaded), adapter_ids(&model));
    assert_eq!(adapter_ids(&model).len(), 2 * 3 * model.config.layers);
    let (ours, theirs) = (params(&loaded), params(&model));
    assert_eq!(ours.len(), theirs.len());
    for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        assert!(
            a == b,
            "parameter {i} of {} differs after loading ({} values)",
            ours.len(),
            a.len()
        );
    }
    let x = ids(&model, 2, 6);
    // The same values (checked above): the logits agree but for the order
    // of NdArray's threaded sums.
    let rel = rel_l2(&logits(&loaded, x.clone()), &logits(&model, x));
    assert!(rel <= 1e-5, "logits after loading differ by {rel:.2e}");
    // An adapter model cannot be exported as a plain HF checkpoint.
    let export = TempDir::new("export");
    let err = loaded.save_hf_dir(&export.0).unwrap_err().to_string();
    assert!(err.contains("merge"), "{err}");
}

/// GPT-OSS's router and expert adapters save under PEFT's names (the
/// expert wrappers nested: `gate_up_proj`'s inside `down_proj`'s when both
/// are adapted) and layout, in a config naming them as
/// `target_parameters`, and load back identically; `all` gives GPT-OSS the
/// attention projections, the router and the experts.
#[test]
fn gpt_oss_adapters_save_and_load_back() {
    type B = NdArray;
    let device = Default::default();
    let base = || CausalLm::<B>::from_hf_dir(fixture("gpt_oss"), &device).unwrap();
    let all = base().with_lora(LoraConfig::new(2), &device).unwrap();
    assert_eq!(
        all.lora_config().unwrap().targets,
        parse_targets("q,k,v,o,router,experts.gate_up,experts.down").unwrap()
    );
    let c = all.config.clone();
    let (e, h, inter) = (c.moe.unwrap().experts, c.hidden_size, c.intermediate_size);
    for (targets, gate_up_module) in [
        (
            "v,router,experts.gate_up,experts.down",
            "mlp.experts.base_layer",
        ),
        ("experts.gate_up", "mlp.experts"),
    ] {
        let config = LoraConfig::new(3)
            .with_alpha(4.0)
            .with_targets(parse_targets(targets).unwrap());
        let model = fill_adapters(base().with_lora(config.clone(), &device).unwrap());
        let dir = TempDir::new("gpt-oss");
        model.save_adapter_dir(&dir.0).unwrap();
        let json: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.0.join("adapter_config.json")).unwrap(),
        )
        .unwrap();
        let parameters: Vec<&str> = config
            .targets
            .iter()
            .filter(|t| t.is_parameter())
            .map(|t| t.hf_name())
            .collect();
        assert_eq!(json["target_parameters"], serde_json::json!(parameters));
        let bytes = std::fs::read(dir.0.join("adapter_model.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let shape = |name: &str| {
            st.tensor(&format!("base_model.model.model.layers.1.{name}"))
                .unwrap_or_else(|e| panic!("{targets}: {name}: {e}"))
                .shape()
                .to_vec()
        };
        assert_eq!(
            shape(&format!("{gate_up_module}.lora_A.weight")),
            [3 * e, h]
        );
        assert_eq!(
            shape(&format!("{gate_up_module}.lora_B.weight")),
            [2 * inter, 3 * e]
        );
        if config.targets.contains(&LoraTarget::ExpertsDown) {
            assert_eq!(shape("mlp.experts.lora_A.weight"), [3 * e, inter]);
            assert_eq!(shape("mlp.experts.lora_B.weight"), [h, 3 * e]);
            assert_eq!(shape("mlp.router.lora_A.weight"), [3, h]);
            assert_eq!(shape("mlp.router.lora_B.weight"), [e, 3]);
        }
        let loaded = base().load_adapter_dir(&dir.0, None, &device).unwrap();
        assert_eq!(loaded.lora_config(), Some(&config));
        assert_eq!(adapter_ids(&loaded), adapter_ids(&model));
        assert!(
            params(&loaded) == params(&model),
            "{targets}: values differ after loading"
        );
    }
}

/// Reference logits of a fixture directory (`reference.safetensors`).
fn reference_of(dir: &Path) -> (Vec<i64>, [usize; 2], Vec<f64>) {
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let ids = st.tensor("input_ids").unwrap();
    let shape = [ids.shape()[0], ids.shape()[1]];
    let ids: Vec<i64> = ids
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let logits: Vec<f64> = st
        .tensor("logits")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
        .collect();
    (ids, shape, logits)
}

/// Adapters that PEFT wrote load onto their base and give PEFT's logits.
fn peft_adapter_gives_peft_logits<B: BastileBackend>(what: &str, base: &str, adapter: &str) {
    let device = Default::default();
    let dir = fixture(adapter);
    let model = CausalLm::<B>::from_hf_dir(fixture(base), &device)
        .unwrap()
        .load_adapter_dir(&dir, None, &device)
        .unwrap();
    let (ids, shape, expected) = reference_of(&dir);
    let got = logits(
        &model,
        Tensor::from_data(TensorData::new(ids, shape), &device),
    );
    let rel = rel_l2(&got, &expected);
    assert!(
        rel <= 1e-4,
        "{what} {adapter}: logits differ from PEFT's by {rel:.2e}"
    );
    eprintln!("{what} {adapter}: PEFT's logits within {rel:.1e}");
}

#[test]
fn peft_adapters_give_peft_logits() {
    for (base, adapter) in [
        ("qwen3", "qwen3_lora"),
        ("llama", "llama_lora"),
        ("gpt_oss", "gpt_oss_lora"),
    ] {
        peft_adapter_gives_peft_logits::<NdArray>("ndarray", base, adapter);
        if runtime_selected("wgpu", cfg!(feature = "wgpu")) {
            #[cfg(feature = "wgpu")]
            {
                bastile::apply(bastile::Patches::default());
                peft_adapter_gives_peft_logits::<bastile::Bastile<burn::backend::Wgpu>>(
                    "wgpu fused",
                    base,
                    adapter,
                );
            }
        }
    }
    // The adapters PEFT wrote check what Bastile saves: saving them again
    // gives the same tensors under the same names, and a config naming
    // the same targets.
    let device = Default::default();
    for (base, adapter) in [("qwen3", "qwen3_lora"), ("gpt_oss", "gpt_oss_lora")] {
        let model = CausalLm::<NdArray>::from_hf_dir(fixture(base), &device)
            .unwrap()
            .load_adapter_dir(fixture(adapter), None, &device)
            .unwrap();
        let dir = TempDir::new("resave");
        model.save_adapter_dir(&dir.0).unwrap();
        let ours = std::fs::read(dir.0.join("adapter_model.safetensors")).unwrap();
        let theirs = std::fs::read(fixture(adapter).join("adapter_model.safetensors")).unwrap();
        let (ours, theirs) = (
            SafeTensors::deserialize(&ours).unwrap(),
            SafeTensors::deserialize(&theirs).unwrap(),
        );
        let mut names: Vec<String> = theirs.names().into_iter().map(String::from).collect();
        names.sort();
        let mut our_names: Vec<String> = ours.names().into_iter().map(String::from).collect();
        our_names.sort();
        assert_eq!(our_names, names, "{adapter}");
        for name in &names {
            let (a, b) = (ours.tensor(name).unwrap(), theirs.tensor(name).unwrap());
            assert_eq!(a.shape(), b.shape(), "{adapter}: {name}");
            assert_eq!(a.data(), b.data(), "{adapter}: {name}");
        }
        let config = |dir: &Path| -> serde_json::Value {
            serde_json::from_str(&std::fs::read_to_string(dir.join("adapter_config.json")).unwrap())
                .unwrap()
        };
        let (ours, theirs) = (config(&dir.0), config(&fixture(adapter)));
        for key in ["target_modules", "target_parameters"] {
            let sorted = |v: &serde_json::Value| {
                let mut names: Vec<String> = v
                    .as_array()
                    .map(|a| a.iter().map(|n| n.as_str().unwrap().to_string()).collect())
                    .unwrap_or_default();
                names.sort();
                names
            };
            assert_eq!(sorted(&ours[key]), sorted(&theirs[key]), "{adapter}: {key}");
        }
    }
    // With BASTILE_LORA_EXPORT=dir, also writes adapters of the qwen3 and
    // gpt_oss fixtures and Bastile's logits for `make_lora_fixtures.py
    // --check` (in `dir/qwen3` and `dir/gpt_oss`).
    if let Ok(out) = std::env::var("BASTILE_LORA_EXPORT") {
        export_for_peft(Path::new(&out));
    }
}

/// Adapters of the qwen3 and gpt_oss fixtures (rsLoRA, a subset of
/// targets, random values) and Bastile's logits of each fixture's
/// reference ids, for PEFT to load and compare.
fn export_for_peft(out: &Path) {
    for (base, targets) in [
        ("qwen3", "k,o,gate,up"),
        ("gpt_oss", "v,router,experts.gate_up"),
    ] {
        export_adapter(base, targets, &out.join(base));
    }
}

fn export_adapter(base: &str, targets: &str, out: &Path) {
    type B = NdArray;
    let device = Default::default();
    let config = LoraConfig::new(5)
        .with_alpha(3.0)
        .with_rslora(true)
        .with_targets(parse_targets(targets).unwrap());
    let model = fill_adapters(
        CausalLm::<B>::from_hf_dir(fixture(base), &device)
            .unwrap()
            .with_lora(config, &device)
            .unwrap(),
    );
    model.save_adapter_dir(out).unwrap();
    let (ids, shape, _) = reference_of(&fixture(base));
    let logits = model
        .logits(Tensor::from_data(TensorData::new(ids, shape), &device))
        .unwrap();
    let dims = logits.dims().to_vec();
    let data: Vec<u8> = values(logits)
        .into_iter()
        .flat_map(|v| (v as f32).to_le_bytes())
        .collect();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, dims, &data).unwrap();
    safetensors::serialize_to_file(
        [("logits", view)],
        None,
        &out.join("bastile_logits.safetensors"),
    )
    .unwrap();
    eprintln!("wrote an adapter and its logits to {}", out.display());
}

#[test]
fn bad_lora_configs_and_adapters_are_errors() {
    type B = NdArray;
    let device = Default::default();
    let qwen3 = || CausalLm::<B>::from_hf_dir(fixture("qwen3"), &device).unwrap();
    let err =
        |r: Result<CausalLm<B>, bastile_models::ModelError>| r.map(|_| ()).unwrap_err().to_string();

    let e = err(qwen3().with_lora(LoraConfig::new(0), &device));
    assert!(e.contains("rank must be at least 1"), "{e}");
    let e = err(qwen3().with_lora(LoraConfig::new(4).with_dropout(1.0), &device));
    assert!(e.contains("dropout"), "{e}");
    let e = err(qwen3().with_lora(LoraConfig::new(4).with_alpha(0.0), &device));
    assert!(e.contains("alpha"), "{e}");
    let e = parse_targets("q,qkv").unwrap_err().to_string();
    assert!(e.contains("`qkv` is not a LoRA target"), "{e}");
    assert_eq!(
        parse_targets("v_proj, q").unwrap(),
        vec![LoraTarget::Query, LoraTarget::Value]
    );
    let gpt_oss = CausalLm::<B>::from_hf_dir(fixture("gpt_oss"), &device).unwrap();
    let e = err(gpt_oss.with_lora(
        LoraConfig::new(4).with_targets(vec![LoraTarget::Gate]),
        &device,
    ));
    assert!(e.contains("no `gate_proj`") && e.contains("router"), "{e}");
    let e = err(qwen3().with_lora(
        LoraConfig::new(4).with_targets(parse_targets("q,router").unwrap()),
        &device,
    ));
    assert!(e.contains("no `router`") && e.contains("dense MLP"), "{e}");
    // PEFT has no dropout on parameters' adapters; Bastile neither.
    let gpt_oss = || CausalLm::<B>::from_hf_dir(fixture("gpt_oss"), &device).unwrap();
    let e = err(gpt_oss().with_lora(LoraConfig::new(4).with_dropout(0.1), &device));
    assert!(e.contains("dropout") && e.contains("router"), "{e}");
    // PEFT's all-linear on GPT-OSS: the attention projections only.
    let attention = gpt_oss()
        .with_lora(
            LoraConfig::new(2).with_targets(parse_targets("all-linear").unwrap()),
            &device,
        )
        .unwrap();
    assert_eq!(
        attention.lora_config().unwrap().targets,
        parse_targets("q,k,v,o").unwrap()
    );
    // A `target_parameters` entry that is not the router's or an
    // expert's weight (a bare `weight` names every linear layer's too),
    // and the router named as a module.
    let dir = TempDir::new("parameters");
    std::fs::create_dir_all(&dir.0).unwrap();
    let original: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("gpt_oss_lora").join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    std::fs::copy(
        fixture("gpt_oss_lora").join("adapter_model.safetensors"),
        dir.0.join("adapter_model.safetensors"),
    )
    .unwrap();
    for (key, value, message) in [
        (
            "target_parameters",
            serde_json::json!(["weight"]),
            "`weight` is not one of",
        ),
        (
            "target_parameters",
            serde_json::json!(["mlp.experts.gate_up_proj_bias"]),
            "`mlp.experts.gate_up_proj_bias` is not one of",
        ),
        (
            "target_modules",
            serde_json::json!(["router"]),
            "not a linear layer",
        ),
    ] {
        let mut json = original.clone();
        json[key] = value;
        std::fs::write(dir.0.join("adapter_config.json"), json.to_string()).unwrap();
        let e = err(gpt_oss().load_adapter_dir(&dir.0, None, &device));
        assert!(e.contains(message), "{e}");
    }
    // The config names the experts' `gate_up_proj` alone while the file
    // holds both expert weights: `gate_up_proj`'s adapter is then expected
    // at the outer wrapper's names, which hold `down_proj`'s (another
    // shape), and the inner wrapper's tensors are unexpected; both named.
    let mut json = original.clone();
    json["target_parameters"] =
        serde_json::json!(["mlp.router.weight", "mlp.experts.gate_up_proj"]);
    std::fs::write(dir.0.join("adapter_config.json"), json.to_string()).unwrap();
    let e = err(gpt_oss().load_adapter_dir(&dir.0, None, &device));
    assert!(
        e.contains("`base_model.model.model.layers.0.mlp.experts.lora_A.weight` has shape")
            && e.contains("unexpected tensors")
            && e.contains("experts.base_layer.lora_A"),
        "{e}"
    );
    let twice = qwen3().with_lora(LoraConfig::new(2), &device).unwrap();
    let e = err(twice.with_lora(LoraConfig::new(2), &device));
    assert!(e.contains("already has LoRA adapters"), "{e}");

    // An adapter trained for another base: shapes that differ, named.
    let e = err(qwen3().load_adapter_dir(fixture("llama_lora"), None, &device));
    assert!(e.contains("has shape") && e.contains("lora_"), "{e}");
    // A missing directory, and an unsupported PEFT option.
    let e = err(qwen3().load_adapter_dir(fixture("no_such_adapter"), None, &device));
    assert!(e.contains("adapter_config.json"), "{e}");
    let dir = TempDir::new("dora");
    std::fs::create_dir_all(&dir.0).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("qwen3_lora").join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    json["use_dora"] = true.into();
    std::fs::write(dir.0.join("adapter_config.json"), json.to_string()).unwrap();
    std::fs::copy(
        fixture("qwen3_lora").join("adapter_model.safetensors"),
        dir.0.join("adapter_model.safetensors"),
    )
    .unwrap();
    let e = err(qwen3().load_adapter_dir(&dir.0, None, &device));
    assert!(e.contains("DoRA"), "{e}");
    // Fewer targets in the config than tensors in the file: unexpected
    // tensors, named.
    json["use_dora"] = false.into();
    json["target_modules"] = serde_json::json!(["q_proj"]);
    std::fs::write(dir.0.join("adapter_config.json"), json.to_string()).unwrap();
    let e = err(qwen3().load_adapter_dir(&dir.0, None, &device));
    assert!(
        e.contains("unexpected tensors") && e.contains("v_proj.lora_A"),
        "{e}"
    );
    // More targets than the file holds: missing tensors, named.
    json["target_modules"] = serde_json::json!(["q_proj", "v_proj"]);
    std::fs::write(dir.0.join("adapter_config.json"), json.to_string()).unwrap();
    std::fs::copy(
        fixture("llama_lora").join("adapter_model.safetensors"),
        dir.0.join("adapter_model.safetensors"),
    )
    .unwrap();
    let e = err(CausalLm::<B>::from_hf_dir(fixture("llama"), &device)
        .unwrap()
        .load_adapter_dir(&dir.0, None, &device)
        .map(|m| m.merge_lora()));
    // llama_lora targets q, v and down: with only q and v named here the
    // down tensors are unexpected.
    assert!(
        e.contains("unexpected tensors") && e.contains("down_proj"),
        "{e}"
    );
}
