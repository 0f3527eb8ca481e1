//! The router's choice (`bastile::router_top_k`): `Bastile<B>` (one kernel
//! on the device and its own autodiff node) against `B` (Burn's host sort,
//! `softmax`, their autodiff) and the f64 reference: the chosen experts
//! exactly, their weights and the logits' gradient. Logits with ties (few
//! distinct values) check the tie order on the fused path; the composite
//! path promises none, so it sees distinct logits.

use crate::common::*;
use bastile::{Bastile, BastileBackend, BastileError, router_top_k};
use bastile_cubecl::reference::router::{top_k_softmax, top_k_softmax_backward};
use bastile_cubecl::testing::{Rng, assert_close, tolerance};
use burn::backend::Autodiff;
use burn::tensor::{DType, Tensor};

/// Router logits `[tokens, experts]` and the weights' gradient
/// `[tokens, k]`.
struct Problem {
    tokens: usize,
    experts: usize,
    k: usize,
    logits: Vec<f64>,
    dweights: Vec<f64>,
}

impl Problem {
    /// With `ties`, every logit is one of five values; else each row holds
    /// distinct values in a random order.
    fn new(rng: &mut Rng, [tokens, experts, k]: [usize; 3], ties: bool, dtype: DType) -> Self {
        let logits = (0..tokens)
            .flat_map(|_| {
                if ties {
                    (0..experts)
                        .map(|_| ((rng.uniform() * 5.0) as i64 - 2) as f64 * 0.5)
                        .collect::<Vec<_>>()
                } else {
                    // A shuffle of experts distinct values, quarter steps:
                    // exact in every dtype.
                    let mut row: Vec<f64> = (0..experts).map(|e| e as f64 * 0.25 - 2.0).collect();
                    rng.shuffle(&mut row);
                    row
                }
            })
            .collect();
        Self {
            tokens,
            experts,
            k,
            logits,
            dweights: randn(rng, tokens * k, 0.0, 1.0, dtype),
        }
    }

    /// The weights, the chosen experts and the logits' gradient on
    /// `Autodiff<X>`.
    fn run<X: BastileBackend>(
        &self,
        dtype: DType,
        device: &X::Device,
    ) -> (Vec<f64>, Vec<i64>, Vec<f64>) {
        let (t, e, k) = (self.tokens, self.experts, self.k);
        let logits = tensor::<Autodiff<X>, 2>(&self.logits, [t, e], dtype, device).require_grad();
        let (weights, chosen) = router_top_k(logits.clone(), k).unwrap();
        assert_eq!(weights.dtype(), dtype);
        assert_eq!(chosen.dims(), [t, k]);
        let dweights = tensor::<Autodiff<X>, 2>(&self.dweights, [t, k], dtype, device);
        let grads = (weights.clone() * dweights).sum().backward();
        let chosen = chosen.into_data().convert::<i64>().to_vec::<i64>().unwrap();
        (
            values(weights.inner()),
            chosen,
            values(logits.grad(&grads).expect("the logits' gradient")),
        )
    }
}

backend_test! {
    fn router_choice_matches_reference<B>(device, name, dtypes) {
        let mut rng = Rng::fresh();
        let seed = rng.seed();
        for &dtype in dtypes {
            let query = bastile::fused::DTypeQuery { dtype };
            assert!(bastile::fused::is_fused::<Bastile<B>, _>(
                &bastile::ops::router::RouterTopK { k: 1 },
                device,
                &query
            ));
            // [tokens, experts, k]: GPT-OSS's 32 experts top-4, one expert,
            // k = experts, odd sizes.
            for (sizes, ties) in [
                ([37usize, 32, 4], true),
                ([37, 32, 4], false),
                ([1, 1, 1], false),
                ([5, 7, 7], true),
                ([129, 9, 2], false),
            ] {
                let problem = Problem::new(&mut rng, sizes, ties, dtype);
                let (weights, chosen) = top_k_softmax(&problem.logits, sizes[1], sizes[2]);
                let dlogits =
                    top_k_softmax_backward(&weights, &chosen, &problem.dweights, sizes[1], sizes[2]);
                let chosen: Vec<i64> = chosen.into_iter().map(|e| e as i64).collect();
                let tol = 2.0 * tolerance(kdtype(dtype));
                let what = format!("{name} {dtype:?} [tokens, experts, k] = {sizes:?}, ties {ties}");
                let fused = problem.run::<Bastile<B>>(dtype, device);
                assert_eq!(fused.1, chosen, "chosen experts {what}");
                assert_close(&format!("weights {what}"), &fused.0, &weights, tol, seed);
                assert_close(&format!("logits' gradient {what}"), &fused.2, &dlogits, tol, seed);
                if !ties && checks_composite(name) {
                    let composite = problem.run::<B>(dtype, device);
                    assert_eq!(composite.1, chosen, "composite chosen experts {what}");
                    assert_close(&format!("composite weights {what}"), &composite.0, &weights, tol, seed);
                    assert_close(
                        &format!("composite logits' gradient {what}"),
                        &composite.2,
                        &dlogits,
                        tol,
                        seed,
                    );
                }
            }
        }
    }
}

backend_test! {
    fn router_choice_ranks_nan_first<B>(device, name, dtypes) {
        // NaN ranks above every number (torch.topk's order), the lower
        // index first among NaNs; its weights are NaN.
        let nan = f64::NAN;
        let logits = [1.0, nan, 3.0, nan, 2.0, -1.0, 0.5, 4.0, 0.0, nan];
        let (_, expected) = top_k_softmax(&logits, 5, 3);
        let expected: Vec<i64> = expected.into_iter().map(|e| e as i64).collect();
        assert_eq!(expected, [1, 3, 2, 4, 2, 1]);
        for &dtype in dtypes {
            let x = tensor::<Bastile<B>, 2>(&logits, [2, 5], dtype, device);
            let (_, chosen) = router_top_k(x, 3).unwrap();
            let chosen = chosen.into_data().convert::<i64>().to_vec::<i64>().unwrap();
            assert_eq!(chosen, expected, "{name} {dtype:?}");
        }
    }
}

#[test]
fn router_choice_rejects_k_outside_the_experts() {
    type B = Bastile<burn::backend::NdArray>;
    let device = Default::default();
    for k in [0, 5] {
        let logits = Tensor::<B, 2>::zeros([3, 4], &device);
        let err = router_top_k(logits, k).unwrap_err();
        assert!(
            matches!(&err, BastileError::Shape(m) if m.contains("1 <= k <= experts")),
            "k {k}: {err}"
        );
    }
}
