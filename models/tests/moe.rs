//! GPT-OSS's mixture of experts: the routed experts against the dense ones
//! (outputs and every gradient, the router's included) and the outputs
//! against an f64 reference, with experts receiving no token, one token and
//! every token; the router's load-balancing loss against f64 (value and
//! router gradients) and HF's, as an option of the model.

use crate::common::{fixture, reference, tensor, values};
use bastile::{CrossEntropyOptions, Reduction};
use bastile_cubecl::FloatDtype;
use bastile_cubecl::reference::geglu;
use bastile_cubecl::testing::{Rng, assert_close, runtime_selected, tolerance};
use bastile_models::moe::{Experts, Moe, RouterLoad};
use bastile_models::{CausalLm, ExpertRouting, HfConfig};
use burn::module::Param;
use burn::nn::Linear;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Int, Tensor, TensorData};

type Cpu = burn::backend::Autodiff<burn::backend::NdArray>;

const TOKENS: usize = 7;
const HIDDEN: usize = 8;
const INTER: usize = 6;
const EXPERTS: usize = 4;
const TOP_K: usize = 2;
/// Low enough that some gate and up values are clamped.
const LIMIT: f64 = 2.0;
const ALPHA: f64 = 1.702;

/// The layer's inputs and parameters, row-major.
struct Case {
    x: Vec<f64>,
    router_weight: Vec<f64>,
    router_bias: Vec<f64>,
    gate_up: Vec<f64>,
    gate_up_bias: Vec<f64>,
    down: Vec<f64>,
    down_bias: Vec<f64>,
    dy: Vec<f64>,
}

impl Case {
    /// Token 0 alone reads feature 0 (`x[0, 0] = 1`, 0 elsewhere), which
    /// only expert 2's router column weighs: token 0 picks experts 2 and 0,
    /// every other token 0 and 1 (router biases 2, 1, 0, -100 well apart
    /// from the small random weights). Expert 0 gets every token, expert 2
    /// one, expert 3 none.
    fn new(rng: &mut Rng) -> Self {
        let mut x = rng.normals(TOKENS * HIDDEN, 0.0, 1.0);
        for token in 0..TOKENS {
            x[token * HIDDEN] = if token == 0 { 1.0 } else { 0.0 };
        }
        let mut router_weight = rng.normals(HIDDEN * EXPERTS, 0.0, 0.02);
        router_weight[2] = 3.0;
        Case {
            x,
            router_weight,
            router_bias: vec![2.0, 1.0, 0.0, -100.0],
            gate_up: rng.normals(EXPERTS * HIDDEN * 2 * INTER, 0.0, 0.5),
            gate_up_bias: rng.normals(EXPERTS * 2 * INTER, 0.0, 0.3),
            down: rng.normals(EXPERTS * INTER * HIDDEN, 0.0, 0.5),
            down_bias: rng.normals(EXPERTS * HIDDEN, 0.0, 0.3),
            dy: rng.normals(TOKENS * HIDDEN, 0.0, 1.0),
        }
    }

    /// The experts each token chooses, in the order of their logits.
    fn choices(&self) -> Vec<[usize; TOP_K]> {
        (0..TOKENS)
            .map(|t| {
                let logits = self.router_logits(t);
                let mut order: Vec<usize> = (0..EXPERTS).collect();
                order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
                [order[0], order[1]]
            })
            .collect()
    }

    fn router_logits(&self, token: usize) -> Vec<f64> {
        (0..EXPERTS)
            .map(|e| {
                self.router_bias[e]
                    + (0..HIDDEN)
                        .map(|d| self.x[token * HIDDEN + d] * self.router_weight[d * EXPERTS + e])
                        .sum::<f64>()
            })
            .collect()
    }

    /// The layer's output in f64.
    fn reference(&self) -> Vec<f64> {
        let mut out = vec![0.0; TOKENS * HIDDEN];
        for (t, chosen) in self.choices().into_iter().enumerate() {
            let logits = self.router_logits(t);
            let top = chosen.map(|e| logits[e]);
            let max = top[0].max(top[1]);
            let sum: f64 = top.iter().map(|l| (l - max).exp()).sum();
            for (j, &e) in chosen.iter().enumerate() {
                let weight = (top[j] - max).exp() / sum;
                let gate_up: Vec<f64> = (0..2 * INTER)
                    .map(|c| {
                        self.gate_up_bias[e * 2 * INTER + c]
                            + (0..HIDDEN)
                                .map(|d| {
                                    self.x[t * HIDDEN + d]
                                        * self.gate_up[(e * HIDDEN + d) * 2 * INTER + c]
                                })
                                .sum::<f64>()
                    })
                    .collect();
                let act = geglu::forward(&gate_up, ALPHA, LIMIT, |v| v);
                for h in 0..HIDDEN {
                    let y = self.down_bias[e * HIDDEN + h]
                        + (0..INTER)
                            .map(|c| act[c] * self.down[(e * INTER + c) * HIDDEN + h])
                            .sum::<f64>();
                    out[t * HIDDEN + h] += weight * y;
                }
            }
        }
        out
    }
}

/// The case's layer on `B`, its parameters in `dtype`.
fn layer<B: AutodiffBackend>(
    case: &Case,
    routing: ExpertRouting,
    dtype: DType,
    device: &B::Device,
) -> Moe<B> {
    fn param<B: Backend, const D: usize>(
        values: &[f64],
        shape: [usize; D],
        dtype: DType,
        device: &B::Device,
    ) -> Param<Tensor<B, D>> {
        Param::from_tensor(tensor::<B, D>(values, shape, device).cast(dtype))
    }
    Moe {
        router: Linear {
            weight: param(&case.router_weight, [HIDDEN, EXPERTS], dtype, device),
            bias: Some(param(&case.router_bias, [EXPERTS], dtype, device)),
        },
        experts: Experts {
            gate_up_proj: param(&case.gate_up, [EXPERTS, HIDDEN, 2 * INTER], dtype, device),
            gate_up_proj_bias: param(&case.gate_up_bias, [EXPERTS, 2 * INTER], dtype, device),
            down_proj: param(&case.down, [EXPERTS, INTER, HIDDEN], dtype, device),
            down_proj_bias: param(&case.down_bias, [EXPERTS, HIDDEN], dtype, device),
        },
        top_k: TOP_K,
        limit: LIMIT,
        routing,
    }
}

/// The layer's output and the gradients of `sum(y ⊙ dy)`: x, router weight
/// and bias, `gate_up` and its bias, `down` and its bias.
fn run<B: AutodiffBackend + bastile::BastileBackend>(
    case: &Case,
    routing: ExpertRouting,
    dtype: DType,
    device: &B::Device,
) -> Vec<Vec<f64>>
where
    B::InnerBackend: bastile::BastileBackend,
{
    let moe = layer::<B>(case, routing, dtype, device);
    let x = tensor::<B, 3>(&case.x, [1, TOKENS, HIDDEN], device)
        .cast(dtype)
        .require_grad();
    let y = moe.forward(x.clone()).unwrap();
    let dy = tensor::<B, 3>(&case.dy, [1, TOKENS, HIDDEN], device).cast(dtype);
    let grads = (y.clone() * dy).sum().backward();
    let router_bias = moe.router.bias.as_ref().unwrap().val();
    let ex = &moe.experts;
    vec![
        values(y.inner()),
        values(x.grad(&grads).unwrap()),
        values(moe.router.weight.val().grad(&grads).unwrap()),
        values(router_bias.grad(&grads).unwrap()),
        values(ex.gate_up_proj.val().grad(&grads).unwrap()),
        values(ex.gate_up_proj_bias.val().grad(&grads).unwrap()),
        values(ex.down_proj.val().grad(&grads).unwrap()),
        values(ex.down_proj_bias.val().grad(&grads).unwrap()),
    ]
}

/// Routed against dense and f64 with parameters in `dtype`, within `tol`
/// (relative L2; twice that between the two paths, four times for the
/// router's gradients).
fn routed_matches_dense<B: AutodiffBackend + bastile::BastileBackend>(
    device: &B::Device,
    backend: &str,
    dtype: DType,
    tol: f64,
) where
    B::InnerBackend: bastile::BastileBackend,
{
    let backend = format!("{backend} {dtype:?}");
    let mut rng = Rng::fresh();
    let seed = rng.seed();
    let case = Case::new(&mut rng);
    let chosen = case.choices();
    assert!(chosen[0] == [2, 0] && chosen[1..].iter().all(|c| *c == [0, 1]));
    let dense = run::<B>(&case, ExpertRouting::Dense, dtype, device);
    let routed = run::<B>(&case, ExpertRouting::Routed, dtype, device);
    assert_close(
        &format!("{backend}: routed output against f64"),
        &routed[0],
        &case.reference(),
        tol,
        seed,
    );
    let names = [
        "output",
        "x gradient",
        "router weight gradient",
        "router bias gradient",
        "gate_up gradient",
        "gate_up bias gradient",
        "down gradient",
        "down bias gradient",
    ];
    for ((name, r), d) in names.iter().zip(&routed).zip(&dense) {
        // Each token's router-logit gradients sum to zero over the experts,
        // so the router's gradients (sums over 7 tokens) are small beside
        // their terms, whose rounding they keep: twice the bound of the
        // other gradients, where one token's term missing would still be
        // off by about a seventh.
        let cancelling = name.starts_with("router");
        assert_close(
            &format!("{backend}: routed {name} against dense"),
            r,
            d,
            if cancelling { 4.0 } else { 2.0 } * tol,
            seed,
        );
    }
    // Expert 3 received no token: nothing flows into its weights.
    let per_expert = HIDDEN * 2 * INTER;
    assert!(routed[4][3 * per_expert..].iter().all(|&g| g == 0.0));
}

/// f32 products run in TF32 on CUDA (10-bit mantissas): about 1e-3 from
/// f64; a wrong term would be off by its whole size.
#[cfg(feature = "cuda")]
const TF32_TOL: f64 = 5e-3;

#[test]
fn routed_experts_match_dense_experts_and_reference() {
    let f32_tol = tolerance(FloatDtype::F32);
    routed_matches_dense::<Cpu>(&Default::default(), "cpu", DType::F32, f32_tol);
    if runtime_selected("wgpu", cfg!(feature = "wgpu")) {
        #[cfg(feature = "wgpu")]
        routed_matches_dense::<burn::backend::Autodiff<bastile::Bastile<burn::backend::Wgpu>>>(
            &Default::default(),
            "wgpu",
            DType::F32,
            f32_tol,
        );
    }
    if runtime_selected("cuda", cfg!(feature = "cuda")) {
        #[cfg(feature = "cuda")]
        {
            type Cuda = burn::backend::Autodiff<bastile::Bastile<burn::backend::Cuda>>;
            let device = Default::default();
            routed_matches_dense::<Cuda>(&device, "cuda", DType::F32, TF32_TOL);
            let bf16_tol = tolerance(FloatDtype::BF16);
            routed_matches_dense::<Cuda>(&device, "cuda", DType::BF16, bf16_tol);
        }
    }
}

/// The GPT-OSS fixture runs its experts routed by default, with the same
/// logits as the dense path.
#[test]
fn gpt_oss_logits_are_the_same_routed() {
    let device = Default::default();
    let dense = CausalLm::<Cpu>::from_hf_dir(fixture("gpt_oss"), &device)
        .unwrap()
        .with_expert_routing(ExpertRouting::Dense)
        .unwrap();
    let routed = CausalLm::<Cpu>::from_hf_dir(fixture("gpt_oss"), &device).unwrap();
    assert_eq!(routed.expert_routing(), Some(ExpertRouting::Routed));
    assert_eq!(dense.expert_routing(), Some(ExpertRouting::Dense));
    let vocab = dense.config.vocab_size as i64;
    let ids: Vec<i64> = (0..11).map(|i| (i * 37 + 5) % vocab).collect();
    let ids = || Tensor::<Cpu, 2, Int>::from_data(TensorData::new(ids.clone(), [1, 11]), &device);
    let expected = values(dense.logits(ids()).unwrap());
    let got = values(routed.logits(ids()).unwrap());
    assert_close(
        "GPT-OSS fixture logits, routed against dense",
        &got,
        &expected,
        2.0 * tolerance(FloatDtype::F32),
        0,
    );
}

/// A model without experts refuses a routing.
#[test]
fn expert_routing_needs_a_mixture_of_experts() {
    let model = CausalLm::<Cpu>::from_hf_dir(fixture("qwen3"), &Default::default()).unwrap();
    assert_eq!(model.expert_routing(), None);
    let err = model
        .with_expert_routing(ExpertRouting::Routed)
        .unwrap_err()
        .to_string();
    assert!(err.contains("mixture-of-experts"), "{err}");
}

impl Case {
    /// The layer's load-balancing loss in f64, `experts · Σ_e f_e · P_e`,
    /// and its gradients with respect to the router weight `[hidden,
    /// experts]` and bias.
    fn router_aux(&self) -> (f64, Vec<f64>, Vec<f64>) {
        let mut assigned = [0.0; EXPERTS];
        for chosen in self.choices() {
            for e in chosen {
                assigned[e] += 1.0;
            }
        }
        let t = TOKENS as f64;
        let scale = EXPERTS as f64 / (t * t);
        let (mut loss, mut weight_grad, mut bias_grad) =
            (0.0, vec![0.0; HIDDEN * EXPERTS], vec![0.0; EXPERTS]);
        for token in 0..TOKENS {
            let logits = self.router_logits(token);
            let max = logits.iter().copied().fold(f64::MIN, f64::max);
            let sum: f64 = logits.iter().map(|l| (l - max).exp()).sum();
            let p: Vec<f64> = logits.iter().map(|l| (l - max).exp() / sum).collect();
            let mean: f64 = (0..EXPERTS).map(|e| assigned[e] * p[e]).sum();
            loss += scale * mean;
            for e in 0..EXPERTS {
                // d(Σ_e c_e p_e)/d logit_e = p_e (c_e − Σ c p).
                let g = scale * p[e] * (assigned[e] - mean);
                bias_grad[e] += g;
                for d in 0..HIDDEN {
                    weight_grad[d * EXPERTS + e] += self.x[token * HIDDEN + d] * g;
                }
            }
        }
        (loss, weight_grad, bias_grad)
    }
}

/// One layer's load-balancing loss and its router gradients against f64.
fn router_load_matches_reference<B: AutodiffBackend + bastile::BastileBackend>(
    device: &B::Device,
    backend: &str,
    tol: f64,
) where
    B::InnerBackend: bastile::BastileBackend,
{
    let mut rng = Rng::fresh();
    let seed = rng.seed();
    let case = Case::new(&mut rng);
    let (loss, weight_grad, bias_grad) = case.router_aux();
    for routing in [ExpertRouting::Dense, ExpertRouting::Routed] {
        let what = |x: &str| format!("{backend}, {routing:?}: router load-balancing {x}");
        let moe = layer::<B>(&case, routing, DType::F32, device);
        let x = tensor::<B, 3>(&case.x, [1, TOKENS, HIDDEN], device);
        let (_, load) = moe.forward_with_load(x, None, true).unwrap();
        let load = load.expect("a router load");
        let weights = RouterLoad::loss_weights(std::slice::from_ref(&load)).unwrap();
        let aux = load.loss_term(weights);
        assert_close(&what("loss"), &values(aux.clone()), &[loss], tol, seed);
        let grads = aux.backward();
        let bias = moe.router.bias.as_ref().unwrap().val();
        let got_weight = values(moe.router.weight.val().grad(&grads).unwrap());
        assert_close(
            &what("weight gradient"),
            &got_weight,
            &weight_grad,
            tol,
            seed,
        );
        let got_bias = values(bias.grad(&grads).unwrap());
        assert_close(&what("bias gradient"), &got_bias, &bias_grad, tol, seed);
    }
}

#[test]
fn router_load_balancing_loss_matches_reference() {
    let f32_tol = tolerance(FloatDtype::F32);
    router_load_matches_reference::<Cpu>(&Default::default(), "cpu", f32_tol);
    if runtime_selected("wgpu", cfg!(feature = "wgpu")) {
        #[cfg(feature = "wgpu")]
        router_load_matches_reference::<
            burn::backend::Autodiff<bastile::Bastile<burn::backend::Wgpu>>,
        >(&Default::default(), "wgpu", f32_tol);
    }
    if runtime_selected("cuda", cfg!(feature = "cuda")) {
        #[cfg(feature = "cuda")]
        router_load_matches_reference::<
            burn::backend::Autodiff<bastile::Bastile<burn::backend::Cuda>>,
        >(&Default::default(), "cuda", TF32_TOL);
    }
}

/// The router load-balancing loss is an option of the model: the fixture
/// that turns it on (coefficient 0.5) without it gives the plain GPT-OSS
/// loss, and with it the plain loss plus 0.5 × HF's load-balancing loss.
#[test]
fn router_load_balancing_loss_is_an_option() {
    let device = Default::default();
    let r = reference("gpt_oss_router_aux");
    let ids_of = |key: &str| {
        let (shape, v) = &r[key];
        let ids: Vec<i64> = v.iter().map(|x| *x as i64).collect();
        Tensor::<Cpu, 2, Int>::from_data(TensorData::new(ids, [shape[0], shape[1]]), &device)
    };
    let loss = |model: &CausalLm<Cpu>| {
        let out = model
            .loss(ids_of("input_ids"), ids_of("labels"), Default::default())
            .unwrap();
        values(out.loss)[0]
    };
    let with_aux = CausalLm::<Cpu>::from_hf_dir(fixture("gpt_oss_router_aux"), &device).unwrap();
    assert_eq!(with_aux.router_aux_loss(), Some(0.5));
    let plain = CausalLm::<Cpu>::from_hf_dir(fixture("gpt_oss"), &device).unwrap();
    assert_eq!(plain.router_aux_loss(), None);
    let without = loss(&with_aux.clone().with_router_aux_loss(None).unwrap());
    assert_eq!(without, loss(&plain));
    let aux = (loss(&with_aux) - without) / 0.5;
    let hf = r["aux_loss"].1[0];
    assert!(
        (aux - hf).abs() <= 1e-4 * hf,
        "load-balancing loss {aux}, HF's {hf}"
    );
    let doubled = loss(&plain.with_router_aux_loss(Some(1.0)).unwrap()) - without;
    assert!(
        (doubled - hf).abs() <= 1e-4 * hf,
        "coefficient 1: {doubled}, HF's {hf}"
    );
}

/// Bad settings of the load-balancing loss are descriptive errors.
#[test]
fn router_load_balancing_loss_settings_are_checked() {
    let device = Default::default();
    let model = CausalLm::<Cpu>::from_hf_dir(fixture("gpt_oss"), &device).unwrap();
    for coef in [-0.1, f64::NAN, f64::INFINITY] {
        let err = model
            .clone()
            .with_router_aux_loss(Some(coef))
            .unwrap_err()
            .to_string();
        assert!(err.contains("finite and not negative"), "{coef}: {err}");
    }
    let qwen = CausalLm::<Cpu>::from_hf_dir(fixture("qwen3"), &device).unwrap();
    let err = qwen
        .with_router_aux_loss(Some(0.01))
        .unwrap_err()
        .to_string();
    assert!(err.contains("needs a mixture-of-experts model"), "{err}");
    let ids = Tensor::<Cpu, 2, Int>::from_data(TensorData::new(vec![1i64, 2, 3], [1, 3]), &device);
    let err = model
        .with_router_aux_loss(Some(0.01))
        .unwrap()
        .loss(
            ids.clone(),
            ids,
            CrossEntropyOptions::default().with_reduction(Reduction::None),
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("not to per-token losses"), "{err}");
    let mut config = HfConfig::from_file(&fixture("gpt_oss").join("config.json")).unwrap();
    config
        .extra
        .insert("output_router_logits".into(), serde_json::Value::Bool(true));
    assert_eq!(
        config.resolve().unwrap().moe.unwrap().router_aux_loss,
        Some(0.001)
    );
    config
        .extra
        .insert("router_aux_loss_coef".into(), serde_json::json!("high"));
    let err = config.resolve().unwrap_err().to_string();
    assert!(
        err.contains("router_aux_loss_coef must be a number"),
        "{err}"
    );
}
