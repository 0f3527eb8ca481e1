//! GPT-OSS's mixture of experts: the routed experts against the dense ones
//! (outputs and every gradient, the router's included) and the outputs
//! against an f64 reference, with experts receiving no token, one token and
//! every token.

use crate::common::{fixture, tensor, values};
use bastile_cubecl::FloatDtype;
use bastile_cubecl::reference::geglu;
use bastile_cubecl::testing::{Rng, assert_close, runtime_selected, tolerance};
use bastile_models::moe::{Experts, Moe};
use bastile_models::{CausalLm, ExpertRouting};
use burn::module::Param;
use burn::nn::Linear;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, TensorData};

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

/// The layer's output and the gradients of `sum(y ⊙ dy)`: x, router weight
/// and bias, `gate_up` and its bias, `down` and its bias.
fn run<B: AutodiffBackend + bastile::BastileBackend>(
    case: &Case,
    routing: ExpertRouting,
    device: &B::Device,
) -> Vec<Vec<f64>>
where
    B::InnerBackend: bastile::BastileBackend,
{
    let param = |values: &[f64], shape| Param::from_tensor(tensor::<B, 3>(values, shape, device));
    let moe = Moe {
        router: Linear {
            weight: Param::from_tensor(tensor::<B, 2>(
                &case.router_weight,
                [HIDDEN, EXPERTS],
                device,
            )),
            bias: Some(Param::from_tensor(tensor::<B, 1>(
                &case.router_bias,
                [EXPERTS],
                device,
            ))),
        },
        experts: Experts {
            gate_up_proj: param(&case.gate_up, [EXPERTS, HIDDEN, 2 * INTER]),
            gate_up_proj_bias: Param::from_tensor(tensor::<B, 2>(
                &case.gate_up_bias,
                [EXPERTS, 2 * INTER],
                device,
            )),
            down_proj: param(&case.down, [EXPERTS, INTER, HIDDEN]),
            down_proj_bias: Param::from_tensor(tensor::<B, 2>(
                &case.down_bias,
                [EXPERTS, HIDDEN],
                device,
            )),
        },
        top_k: TOP_K,
        limit: LIMIT,
        routing,
    };
    let x = tensor::<B, 3>(&case.x, [1, TOKENS, HIDDEN], device).require_grad();
    let y = moe.forward(x.clone()).unwrap();
    let dy = tensor::<B, 3>(&case.dy, [1, TOKENS, HIDDEN], device);
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

fn routed_matches_dense<B: AutodiffBackend + bastile::BastileBackend>(
    device: &B::Device,
    backend: &str,
) where
    B::InnerBackend: bastile::BastileBackend,
{
    let mut rng = Rng::fresh();
    let seed = rng.seed();
    let case = Case::new(&mut rng);
    let chosen = case.choices();
    assert!(chosen[0] == [2, 0] && chosen[1..].iter().all(|c| *c == [0, 1]));
    let dense = run::<B>(&case, ExpertRouting::Dense, device);
    let routed = run::<B>(&case, ExpertRouting::Routed, device);
    let tol = tolerance(FloatDtype::F32);
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
        assert_close(
            &format!("{backend}: routed {name} against dense"),
            r,
            d,
            2.0 * tol,
            seed,
        );
    }
    // Expert 3 received no token: nothing flows into its weights.
    let per_expert = HIDDEN * 2 * INTER;
    assert!(routed[4][3 * per_expert..].iter().all(|&g| g == 0.0));
}

#[test]
fn routed_experts_match_dense_experts_and_reference() {
    routed_matches_dense::<Cpu>(&Default::default(), "cpu");
    if runtime_selected("wgpu", cfg!(feature = "wgpu")) {
        #[cfg(feature = "wgpu")]
        routed_matches_dense::<burn::backend::Autodiff<bastile::Bastile<burn::backend::Wgpu>>>(
            &Default::default(),
            "wgpu",
        );
    }
}

/// The GPT-OSS fixture gives the same logits with routed and dense experts.
#[test]
fn gpt_oss_logits_are_the_same_routed() {
    let device = Default::default();
    let dense = CausalLm::<Cpu>::from_hf_dir(fixture("gpt_oss"), &device).unwrap();
    let routed = CausalLm::<Cpu>::from_hf_dir(fixture("gpt_oss"), &device)
        .unwrap()
        .with_expert_routing(ExpertRouting::Routed)
        .unwrap();
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
    let err = model
        .with_expert_routing(ExpertRouting::Routed)
        .unwrap_err()
        .to_string();
    assert!(err.contains("mixture-of-experts"), "{err}");
}
