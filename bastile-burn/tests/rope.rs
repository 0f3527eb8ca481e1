//! RoPE through Burn: `Bastile<B>` (fused, q and k in one launch) against
//! `B` (composite) and the f64 reference, forward and gradients under
//! `Autodiff`, both layouts and pairings, GQA, offsets and position ids;
//! the tables against HF transformers' (default, llama3, YaRN); the
//! burn-nn drop-in.

use crate::common::*;
use bastile::nn::{RopeScaling, RotaryEncodingConfig, rope_frequencies};
use bastile::{
    Bastile, BastileBackend, BastileError, RopeLayout, RopeOptions, RopePairing, RopeTables, rope,
};
use bastile_cubecl::reference::rope as reference;
use bastile_cubecl::testing::{Rng, assert_close, round_to, tolerance};
use burn::backend::Autodiff;
use burn::tensor::{DType, Distribution, Int, Tensor, TensorData};

#[derive(Clone, Copy, Debug)]
struct Case {
    batch: usize,
    q_heads: usize,
    k_heads: usize,
    seq: usize,
    head_dim: usize,
    layout: RopeLayout,
    pairing: RopePairing,
    offset: usize,
    /// Explicit, per-sequence position ids instead of `offset..`.
    positions: bool,
}

impl Case {
    fn shape(&self, heads: usize) -> [usize; 4] {
        match self.layout {
            RopeLayout::Bhsd => [self.batch, heads, self.seq, self.head_dim],
            RopeLayout::Bshd => [self.batch, self.seq, heads, self.head_dim],
        }
    }
}

/// The position of every (batch, seq) slot.
fn position_ids(case: &Case) -> Vec<usize> {
    (0..case.batch * case.seq)
        .map(|i| {
            let (b, s) = (i / case.seq, i % case.seq);
            if case.positions {
                (s * 7 + b * 3) % 40
            } else {
                case.offset + s
            }
        })
        .collect()
}

/// Rotates logical `[b, h, s, d]`-ordered values in the case's layout.
fn expected(
    case: &Case,
    heads: usize,
    x: &[f64],
    cos: &[f64],
    sin: &[f64],
    inverse: bool,
    dtype: DType,
) -> Vec<f64> {
    let (d, half) = (case.head_dim, case.head_dim / 2);
    let pos = position_ids(case);
    let mut out = vec![0.0; x.len()];
    for b in 0..case.batch {
        for h in 0..heads {
            for s in 0..case.seq {
                let at = match case.layout {
                    RopeLayout::Bhsd => ((b * heads + h) * case.seq + s) * d,
                    RopeLayout::Bshd => ((b * case.seq + s) * heads + h) * d,
                };
                let p = pos[b * case.seq + s];
                let rotated = reference::rotate(
                    &x[at..at + d],
                    &cos[p * half..(p + 1) * half],
                    &sin[p * half..(p + 1) * half],
                    case.pairing,
                    inverse,
                    |v| round_to(kdtype(dtype), v),
                );
                out[at..at + d].copy_from_slice(&rotated);
            }
        }
    }
    out
}

/// `(q_out, k_out, dq, dk)` of `Autodiff<X>` with `dq_out`, `dk_out` as
/// output gradients.
#[allow(clippy::too_many_arguments)]
fn run<X: BastileBackend>(
    case: &Case,
    q: &[f64],
    k: &[f64],
    dq: &[f64],
    dk: &[f64],
    inv_freq: &[f32],
    dtype: DType,
    device: &X::Device,
) -> [Vec<f64>; 4] {
    type A<X> = Autodiff<X>;
    let qt = tensor::<A<X>, 4>(q, case.shape(case.q_heads), dtype, device).require_grad();
    let kt = tensor::<A<X>, 4>(k, case.shape(case.k_heads), dtype, device).require_grad();
    let tables = RopeTables::<A<X>>::new(48, inv_freq, 1.0, device);
    let (tables, offset) = if case.positions {
        let ids: Vec<i64> = position_ids(case).into_iter().map(|p| p as i64).collect();
        let ids =
            Tensor::<A<X>, 2, Int>::from_data(TensorData::new(ids, [case.batch, case.seq]), device);
        (tables.gather(ids).unwrap(), 0)
    } else {
        (tables, case.offset)
    };
    let options = RopeOptions {
        layout: case.layout,
        pairing: case.pairing,
        offset,
        inverse: false,
    };
    let (qo, ko) = rope(qt.clone(), kt.clone(), &tables, options).unwrap();
    let dqt = tensor::<A<X>, 4>(dq, case.shape(case.q_heads), dtype, device);
    let dkt = tensor::<A<X>, 4>(dk, case.shape(case.k_heads), dtype, device);
    let grads = ((qo.clone() * dqt).sum() + (ko.clone() * dkt).sum()).backward();
    [
        values(qo.inner()),
        values(ko.inner()),
        values(qt.grad(&grads).expect("dq")),
        values(kt.grad(&grads).expect("dk")),
    ]
}

backend_test! {
    fn rope_fused_and_composite_match_reference_under_autodiff<B>(device, name, dtypes) {
        let mut rng = Rng::fresh();
        let seed = rng.seed();
        let base = Case {
            batch: 2,
            q_heads: 4,
            k_heads: 2,
            seq: 7,
            head_dim: 64,
            layout: RopeLayout::Bhsd,
            pairing: RopePairing::Half,
            offset: 0,
            positions: false,
        };
        let cases = [
            base,
            Case {
                layout: RopeLayout::Bshd,
                q_heads: 8,
                k_heads: 1,
                head_dim: 128,
                offset: 5,
                ..base
            },
            Case {
                pairing: RopePairing::Interleaved,
                head_dim: 80,
                seq: 13,
                ..base
            },
            Case {
                positions: true,
                layout: RopeLayout::Bshd,
                seq: 9,
                ..base
            },
            Case {
                batch: 1,
                q_heads: 16,
                k_heads: 8,
                seq: 1,
                ..base
            },
        ];
        for &dtype in dtypes {
            let query = bastile::fused::DTypeQuery { dtype };
            let op = bastile::ops::rope::Rope::default();
            assert!(bastile::fused::is_fused::<Bastile<B>, _>(
                &op, device, &query
            ));
            for case in cases {
                let (inv, _) =
                    rope_frequencies(case.head_dim, 10_000.0, &RopeScaling::None).unwrap();
                // The tables as the device computed them: the reference
                // rotates with the same f32 values.
                let tables = RopeTables::<B>::new(48, &inv, 1.0, device);
                let cos = values(tables.cos);
                let sin = values(tables.sin);
                let nq = case.batch * case.q_heads * case.seq * case.head_dim;
                let nk = case.batch * case.k_heads * case.seq * case.head_dim;
                let q = randn(&mut rng, nq, 0.0, 1.0, dtype);
                let k = randn(&mut rng, nk, 0.0, 1.0, dtype);
                let dq = randn(&mut rng, nq, 0.0, 1.0, dtype);
                let dk = randn(&mut rng, nk, 0.0, 1.0, dtype);
                let want = [
                    expected(&case, case.q_heads, &q, &cos, &sin, false, dtype),
                    expected(&case, case.k_heads, &k, &cos, &sin, false, dtype),
                    expected(&case, case.q_heads, &dq, &cos, &sin, true, dtype),
                    expected(&case, case.k_heads, &dk, &cos, &sin, true, dtype),
                ];
                let fused = run::<Bastile<B>>(&case, &q, &k, &dq, &dk, &inv, dtype, device);
                let composite = checks_composite(name)
                    .then(|| run::<B>(&case, &q, &k, &dq, &dk, &inv, dtype, device));
                let tol = tolerance(kdtype(dtype));
                for (i, label) in ["q", "k", "dq", "dk"].into_iter().enumerate() {
                    let what = format!("{label} {name} {dtype:?} {case:?}");
                    assert_close(&format!("fused {what}"), &fused[i], &want[i], tol, seed);
                    if let Some(composite) = &composite {
                        assert_close(
                            &format!("composite {what}"),
                            &composite[i],
                            &want[i],
                            tol,
                            seed,
                        );
                    }
                }
            }
        }
    }
}

/// HF transformers' RoPE tables (scripts/rope_fixtures.py).
fn fixture() -> serde_json::Value {
    let text = include_str!("fixtures/rope_tables.json");
    serde_json::from_str(text).expect("valid fixture")
}

fn floats(v: &serde_json::Value) -> Vec<f64> {
    v.as_array()
        .expect("array")
        .iter()
        .flat_map(|x| match x.as_array() {
            Some(row) => row.iter().map(|y| y.as_f64().unwrap()).collect(),
            None => vec![x.as_f64().unwrap()],
        })
        .collect()
}

fn configs() -> Vec<(&'static str, f64, RopeScaling)> {
    vec![
        ("qwen3_default", 1_000_000.0, RopeScaling::None),
        (
            "llama3",
            500_000.0,
            RopeScaling::Llama3 {
                factor: 32.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            },
        ),
        (
            "gpt_oss_yarn",
            150_000.0,
            RopeScaling::Yarn {
                factor: 32.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                original_max_position_embeddings: 4096,
                truncate: false,
                attention_factor: None,
                mscale: None,
                mscale_all_dim: None,
            },
        ),
    ]
}

#[test]
fn rope_frequencies_match_hf_transformers() {
    let fx = fixture();
    for (key, theta, scaling) in configs() {
        let e = &fx[key];
        let head_dim = e["head_dim"].as_u64().unwrap() as usize;
        let (inv, attention) = rope_frequencies(head_dim, theta, &scaling).unwrap();
        let want = floats(&e["inv_freq"]);
        let got: Vec<f64> = inv.iter().map(|&v| v as f64).collect();
        assert_close(&format!("{key} inv_freq"), &got, &want, 1e-6, 0);
        let want_att = e["attention_scaling"].as_f64().unwrap();
        assert!(
            (attention as f64 - want_att).abs() < 1e-6,
            "{key}: attention scaling {attention} vs {want_att}"
        );
    }
}

backend_test! {
    /// The device-built tables at HF's sample positions (up to 70000), from
    /// HF's own inverse frequencies: `rope_frequencies` may differ from them by
    /// an ulp (HF's CPU `pow` is not correctly rounded), which an angle of 7e4
    /// rad would amplify past any useful bound.
    fn rope_tables_match_hf_transformers<B>(device, name, _dtypes) {
        let fx = fixture();
        for (key, _, _) in configs() {
            let e = &fx[key];
            let inv: Vec<f32> = floats(&e["inv_freq"]).iter().map(|&v| v as f32).collect();
            let attention = e["attention_scaling"].as_f64().unwrap() as f32;
            let tables = RopeTables::<B>::new(70_001, &inv, attention, device);
            let positions: Vec<i64> = e["positions"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| p.as_i64().unwrap())
                .collect();
            let n = positions.len();
            let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(positions, [1, n]), device);
            let picked = tables.gather(ids).unwrap();
            for (label, got, want) in [
                ("cos", values(picked.cos), floats(&e["cos"])),
                ("sin", values(picked.sin), floats(&e["sin"])),
            ] {
                let worst = got
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f64, f64::max);
                assert!(
                    worst < 2e-5,
                    "{name} {key} {label}: max abs error {worst:e}"
                );
            }
        }
    }
}

backend_test! {
    /// With interleaved pairing, `bastile::nn::RotaryEncoding` computes what
    /// `burn::nn::RotaryEncoding` does. Burn's module runs on NdArray for the
    /// expected values: on CUDA its rotation is a matmul that may use TF32.
    fn rotary_encoding_matches_burn_nn_with_interleaved_pairing<B>(device, name, _dtypes) {
        type F<B> = Bastile<B>;
        type Cpu = burn::backend::NdArray;
        let theirs = burn::nn::RotaryEncodingConfig::new(32, 16).init::<Cpu>(&Default::default());
        let ours = RotaryEncodingConfig::new(32, 16)
            .with_pairing(RopePairing::Interleaved)
            .init::<F<B>>(device);
        let x = Tensor::<F<B>, 4>::random([2, 3, 10, 16], Distribution::Normal(0.0, 1.0), device);
        let x_cpu = Tensor::<Cpu, 4>::from_data(x.to_data(), &Default::default());
        assert_close(
            &format!("{name} RotaryEncoding forward"),
            &values(ours.forward(x.clone())),
            &values(theirs.forward(x_cpu.clone())),
            1e-5,
            0,
        );
        assert_close(
            &format!("{name} RotaryEncoding apply(start 4)"),
            &values(ours.apply(x, 4)),
            &values(theirs.apply(x_cpu, 4)),
            1e-5,
            0,
        );
    }
}

#[test]
fn rope_rejects_bad_input() {
    type B = Bastile<burn::backend::NdArray>;
    let device = Default::default();
    let rotary = RotaryEncodingConfig::new(8, 16).init::<B>(&device);
    let q = Tensor::<B, 4>::zeros([1, 2, 4, 16], &device);
    let k = Tensor::<B, 4>::zeros([1, 1, 4, 16], &device);
    let ok = rotary.forward_qk(q.clone(), k.clone(), RopeLayout::Bhsd, 4);
    assert!(ok.is_ok());
    let err = rotary.forward_qk(q.clone(), k.clone(), RopeLayout::Bhsd, 5);
    assert!(matches!(err, Err(BastileError::Shape(_))), "{err:?}");
    let wrong_dim = Tensor::<B, 4>::zeros([1, 1, 4, 8], &device);
    let err = rotary.forward_qk(q.clone(), wrong_dim, RopeLayout::Bhsd, 0);
    assert!(matches!(err, Err(BastileError::Shape(_))), "{err:?}");
    let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(vec![0i64, 1, 2, 9], [1, 4]), &device);
    let err = rotary.forward_qk_positions(q, k, RopeLayout::Bhsd, ids);
    assert!(matches!(err, Err(BastileError::Shape(_))), "{err:?}");
    assert!(matches!(
        RotaryEncodingConfig::new(8, 15).try_init::<B>(&device),
        Err(BastileError::Config(_))
    ));
}
