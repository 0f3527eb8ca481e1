//! Attention through Burn: `Autodiff<Bastile<B>>` (fused kernels) and
//! `Autodiff<B>` (composite graph) against the f64 reference, output and
//! the gradients of q, k, v and the sinks; every mask option, GQA,
//! sequence-major views read in place; both the tiled kernels and the
//! matrix-product path (several query blocks per case); Burn's own `module::attention` on
//! `Bastile<B>` against the reference; and the errors of the checked entry
//! point.

use crate::common::*;
use bastile::{
    AttentionKernels, AttentionOptions, Bastile, BastileBackend, BastileError, attention,
    set_attention_kernels, set_deterministic_attention,
};
use bastile_cubecl::reference::attention::{self as reference, AttentionSpec};
use bastile_cubecl::testing::{Rng, assert_close, seq_major, tolerance};
use burn::backend::Autodiff;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{DType, Int, Shape, Tensor, TensorData};

#[derive(Clone, Debug)]
struct Case {
    batch: usize,
    heads: usize,
    kv_heads: usize,
    seq_q: usize,
    seq_k: usize,
    head_dim: usize,
    causal: bool,
    window: Option<usize>,
    sinks: bool,
    key_lengths: Option<Vec<usize>>,
    /// Per batch entry, the lengths of the documents its row packs (the
    /// positions after them form one more).
    documents: Option<Vec<Vec<usize>>>,
    /// Build q, k, v as `[batch, seq, heads, d]` and view them head-major.
    seq_major: bool,
}

impl Case {
    /// Each key position's place in its document, `[batch, seq_k]`.
    fn positions(&self) -> Option<Vec<i64>> {
        let rows = self.documents.as_ref()?;
        let mut positions = Vec::with_capacity(self.batch * self.seq_k);
        for lengths in rows {
            let rest = self.seq_k - lengths.iter().sum::<usize>();
            for &n in lengths.iter().chain([&rest]) {
                positions.extend(0..n as i64);
            }
        }
        Some(positions)
    }

    /// The document of every key position, as the reference takes it.
    fn document_ids(&self) -> Option<Vec<usize>> {
        let mut doc = 0;
        let positions = self.positions()?;
        Some(
            positions
                .iter()
                .enumerate()
                .map(|(i, &p)| {
                    doc += usize::from(p == 0 && i > 0);
                    doc
                })
                .collect(),
        )
    }
}

struct Inputs {
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    dout: Vec<f64>,
    sinks: Vec<f64>,
}

/// `(out, dq, dk, dv, dsinks)`.
type Outputs = (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>);

/// A `[b, h, s, d]` tensor, built sequence-major and viewed head-major
/// when asked.
fn heads<X: burn::tensor::backend::Backend>(
    values: &[f64],
    dims: [usize; 4],
    sequence_major: bool,
    dtype: DType,
    device: &X::Device,
) -> Tensor<X, 4> {
    let [b, h, s, d] = dims;
    if !sequence_major {
        return tensor::<X, 4>(values, dims, dtype, device);
    }
    tensor::<X, 4>(&seq_major(values, dims), [b, s, h, d], dtype, device).swap_dims(1, 2)
}

fn run<X: BastileBackend>(c: &Case, x: &Inputs, dtype: DType, device: &X::Device) -> Outputs {
    let q_dims = [c.batch, c.heads, c.seq_q, c.head_dim];
    let k_dims = [c.batch, c.kv_heads, c.seq_k, c.head_dim];
    let q = heads::<Autodiff<X>>(&x.q, q_dims, c.seq_major, dtype, device).require_grad();
    let k = heads::<Autodiff<X>>(&x.k, k_dims, c.seq_major, dtype, device).require_grad();
    let v = heads::<Autodiff<X>>(&x.v, k_dims, c.seq_major, dtype, device).require_grad();
    let sinks = c
        .sinks
        .then(|| tensor::<Autodiff<X>, 1>(&x.sinks, [c.heads], DType::F32, device).require_grad());
    let lengths = c.key_lengths.as_ref().map(|l| {
        let data: Vec<i64> = l.iter().map(|&n| n as i64).collect();
        Tensor::<Autodiff<X>, 1, Int>::from_data(TensorData::new(data, [c.batch]), device)
    });
    let positions = c.positions().map(|p| {
        Tensor::<Autodiff<X>, 2, Int>::from_data(TensorData::new(p, [c.batch, c.seq_k]), device)
    });
    let options = AttentionOptions {
        scale: None,
        causal: c.causal,
        window: c.window,
    };
    let out = attention(
        q.clone(),
        k.clone(),
        v.clone(),
        sinks.clone(),
        lengths,
        positions,
        options,
    )
    .unwrap();
    let dout = tensor::<Autodiff<X>, 4>(&x.dout, q_dims, dtype, device);
    let grads = (out.clone().cast(DType::F32) * dout.cast(DType::F32))
        .sum()
        .backward();
    let g = |t: &Tensor<Autodiff<X>, 4>| values(t.grad(&grads).expect("gradient"));
    let dsinks = sinks.map_or(vec![], |s| values(s.grad(&grads).expect("sink gradient")));
    (values(out.inner()), g(&q), g(&k), g(&v), dsinks)
}

/// Checks the fused path on `c`, and the composite too when `composite`
/// (it does not depend on the kernel family, so one pass of it suffices).
fn check<B: BastileBackend + bastile::ops::KernelBackend>(
    c: &Case,
    dtype: DType,
    name: &str,
    device: &B::Device,
    rng: &mut Rng,
    composite: bool,
) {
    let seed = rng.seed();
    let n_q = c.batch * c.heads * c.seq_q * c.head_dim;
    let n_k = c.batch * c.kv_heads * c.seq_k * c.head_dim;
    let x = Inputs {
        q: randn(rng, n_q, 0.0, 1.5, dtype),
        k: randn(rng, n_k, 0.0, 1.5, dtype),
        v: randn(rng, n_k, 0.0, 1.0, dtype),
        dout: randn(rng, n_q, 0.0, 1.0, dtype),
        sinks: randn(rng, c.heads, 1.0, 1.0, DType::F32),
    };
    let spec = AttentionSpec {
        batch: c.batch,
        heads: c.heads,
        kv_heads: c.kv_heads,
        seq_q: c.seq_q,
        seq_k: c.seq_k,
        head_dim: c.head_dim,
        scale: 1.0 / (c.head_dim as f64).sqrt(),
        causal: c.causal,
        window: c.window,
        key_lengths: c.key_lengths.clone(),
        documents: c.document_ids(),
        sinks: c.sinks.then(|| x.sinks.clone()),
    };
    let (out_ref, _) = reference::forward(&spec, &x.q, &x.k, &x.v);
    let dims = [
        Shape::new([c.batch, c.heads, c.seq_q, c.head_dim]),
        Shape::new([c.batch, c.kv_heads, c.seq_k, c.head_dim]),
    ];
    let resolved = bastile::ops::attention::AttentionSpec {
        scale: spec.scale,
        causal: c.causal,
        window: c.window,
        documents: c.documents.is_some(),
    };
    assert!(
        bastile::fused::is_fused::<Bastile<B>, _>(
            &bastile::ops::attention::Attention { spec: resolved },
            device,
            &bastile::ops::attention::AttentionQuery {
                dims,
                dtype,
                spec: resolved
            }
        ),
        "{name}: the kernels must take {c:?}"
    );
    let tol = tolerance(kdtype(dtype)) * if dtype == DType::F32 { 4.0 } else { 1.0 };
    let mut paths = vec![("fused", run::<Bastile<B>>(c, &x, dtype, device))];
    // The composite multiplies q·kᵀ in the input dtype (HF's eager
    // attention), so only its f32 results are held to the reference.
    if composite && dtype == DType::F32 {
        paths.push(("composite", run::<B>(c, &x, dtype, device)));
    }
    for (path, got) in paths {
        let what = format!("{path} {name} {dtype:?} {c:?}");
        // Burn's f32 matmul on CUDA runs tensor-core kernels at TF32
        // precision (relative errors ~5e-4 measured on an H100); the
        // composite is held to that, the fused path to f32.
        let tol = if path == "composite" {
            tol.max(2e-3)
        } else {
            tol
        };
        assert_close(&format!("out {what}"), &got.0, &out_ref, tol, seed);
        // The fused backward reads its own stored output (rounded to the
        // dtype) for Δ, and so does the reference; the composite, held to
        // the reference in f32 only, differs from it by f32 rounding.
        let g = reference::backward(&spec, &x.q, &x.k, &x.v, &got.0, &x.dout);
        assert_close(&format!("dq {what}"), &got.1, &g.dq, tol, seed);
        assert_close(&format!("dk {what}"), &got.2, &g.dk, tol, seed);
        assert_close(&format!("dv {what}"), &got.3, &g.dv, tol, seed);
        if c.sinks {
            assert_close(&format!("dsinks {what}"), &got.4, &g.dsinks, tol, seed);
        }
    }
}

backend_test! {
    fn attention_fused_and_composite_match_reference_under_autodiff<B>(device, name, dtypes) {
        // Every size takes the fused kernels here.
        bastile::ops::attention::set_fused_from(0);
        let mut rng = Rng::fresh();
        let cases = [
            Case {
                batch: 2,
                heads: 4,
                kv_heads: 2,
                seq_q: 37,
                seq_k: 37,
                head_dim: 64,
                causal: true,
                window: None,
                sinks: true,
                key_lengths: None,
                documents: None,
                seq_major: true,
            },
            Case {
                batch: 1,
                heads: 8,
                kv_heads: 1,
                seq_q: 20,
                seq_k: 20,
                head_dim: 80,
                causal: true,
                window: Some(5),
                sinks: true,
                key_lengths: Some(vec![13]),
                documents: None,
                seq_major: false,
            },
            Case {
                batch: 2,
                heads: 2,
                kv_heads: 2,
                seq_q: 9,
                seq_k: 12,
                head_dim: 64,
                causal: false,
                window: None,
                sinks: false,
                key_lengths: Some(vec![12, 5]),
                documents: None,
                seq_major: false,
            },
            // Packed rows: documents of one position, odd lengths, one
            // document filling its row; a window and sinks on top.
            Case {
                batch: 3,
                heads: 4,
                kv_heads: 2,
                seq_q: 29,
                seq_k: 29,
                head_dim: 64,
                causal: true,
                window: Some(9),
                sinks: true,
                key_lengths: None,
                documents: Some(vec![vec![1, 10, 1], vec![29], vec![13]]),
                seq_major: true,
            },
        ];
        // Both kernel families; blocks of 8 query rows split every case
        // into several blocks of the matrix-product path, with key ranges
        // cut by the causal and window masks.
        let mut kernels = vec![
            AttentionKernels::Tiled,
            AttentionKernels::MatrixProducts { block_rows: 8 },
        ];
        // On CUDA also the default (cuDNN's fused attention for the cases
        // its graphs take, where it is loaded) and Bastile's own
        // tensor-core kernels.
        if name.starts_with("cuda") {
            kernels.extend([AttentionKernels::Auto, AttentionKernels::TensorCores]);
        }
        for (family, &k) in kernels.iter().enumerate() {
            set_attention_kernels(k);
            for (d, &dtype) in dtypes.iter().enumerate() {
                for (i, c) in cases.iter().enumerate() {
                    // Off CUDA the matrix-product family (whose products
                    // Burn tunes for every block shape) takes each case in
                    // one dtype, the dtypes taking turns.
                    if family > 0 && !takes_turn(name, i, d, dtypes.len()) {
                        continue;
                    }
                    let what = format!("{name} {k:?}");
                    let composite = family == 0 && checks_composite(name);
                    check::<B>(c, dtype, &what, device, &mut rng, composite);
                }
            }
        }
        // The deterministic backward: the same bits on every run, and the
        // right gradients, in every family.
        set_deterministic_attention(true);
        for &k in &kernels {
            set_attention_kernels(k);
            deterministic_runs::<B>(name, &format!("{k:?}"), device, dtypes, &mut rng);
        }
        set_deterministic_attention(false);
        set_attention_kernels(AttentionKernels::Auto);
    }
}

/// With the deterministic backward on, three runs of one problem (GQA,
/// causal, several blocks, sequence-major views) give the same gradient
/// bits, and they match the reference.
fn deterministic_runs<B: BastileBackend + bastile::ops::KernelBackend>(
    name: &str,
    family: &str,
    device: &B::Device,
    dtypes: &[DType],
    rng: &mut Rng,
) {
    let c = Case {
        batch: 1,
        heads: 8,
        kv_heads: 2,
        seq_q: 130,
        seq_k: 130,
        head_dim: 64,
        causal: true,
        window: None,
        sinks: false,
        key_lengths: None,
        documents: None,
        seq_major: true,
    };
    let (n_q, n_k) = (8 * 130 * 64, 2 * 130 * 64);
    for &dtype in dtypes {
        let x = Inputs {
            q: randn(rng, n_q, 0.0, 1.5, dtype),
            k: randn(rng, n_k, 0.0, 1.5, dtype),
            v: randn(rng, n_k, 0.0, 1.0, dtype),
            dout: randn(rng, n_q, 0.0, 1.0, dtype),
            sinks: vec![],
        };
        let first = run::<Bastile<B>>(&c, &x, dtype, device);
        for _ in 0..2 {
            let again = run::<Bastile<B>>(&c, &x, dtype, device);
            for (what, a, b) in [
                ("dq", &first.1, &again.1),
                ("dk", &first.2, &again.2),
                ("dv", &first.3, &again.3),
            ] {
                // Equal f64 widenings are equal bits.
                let differ = a.iter().zip(b).filter(|(x, y)| x != y).count();
                assert_eq!(
                    differ, 0,
                    "{name} {family} {dtype:?}: {what} differs between runs"
                );
            }
        }
        let what = format!("{name} {family} deterministic");
        check::<B>(&c, dtype, &what, device, rng, false);
    }
}

backend_test! {
    fn burn_module_attention_on_bastile_matches_reference<B>(device, name, _dtypes) {
        bastile::ops::attention::set_fused_from(0);
        let mut rng = Rng::fresh();
        let dims = [2, 3, 21, 64];
        let n = dims.iter().product();
        let x: Vec<Vec<f64>> = (0..3)
            .map(|_| randn(&mut rng, n, 0.0, 1.0, DType::F32))
            .collect();
        let t = |i: usize| tensor::<Bastile<B>, 4>(&x[i], dims, DType::F32, device);
        for causal in [false, true] {
            let options = AttentionModuleOptions {
                scale: None,
                softcap: None,
                is_causal: causal,
            };
            let spec = AttentionSpec {
                batch: dims[0],
                heads: dims[1],
                kv_heads: dims[1],
                seq_q: dims[2],
                seq_k: dims[2],
                head_dim: dims[3],
                scale: 1.0 / (dims[3] as f64).sqrt(),
                causal,
                window: None,
                key_lengths: None,
                documents: None,
                sinks: None,
            };
            let (expected, _) = reference::forward(&spec, &x[0], &x[1], &x[2]);
            let ours = burn::tensor::module::attention(t(0), t(1), t(2), None, None, options);
            assert_close(
                &format!("{name} module attention causal {causal}"),
                &values(ours),
                &expected,
                4e-5,
                rng.seed(),
            );
        }
    }
}

#[test]
fn attention_rejects_bad_input() {
    type B = Bastile<burn::backend::NdArray>;
    let device = Default::default();
    let t = |dims: [usize; 4]| Tensor::<B, 4>::zeros(dims, &device);
    // Query, key and value dims, the sinks' and key lengths' lengths.
    let call = |[q, k, v]: [[usize; 4]; 3],
                sinks: Option<usize>,
                lengths: Option<usize>,
                options: AttentionOptions| {
        let sinks = sinks.map(|n| Tensor::<B, 1>::zeros([n], &device));
        let lengths = lengths.map(|n| Tensor::<B, 1, Int>::zeros([n], &device));
        attention(t(q), t(k), t(v), sinks, lengths, None, options)
    };
    let ok = AttentionOptions::default();
    let good = [1, 2, 4, 8];
    let shape_err =
        |r: Result<Tensor<B, 4>, BastileError>| matches!(r, Err(BastileError::Shape(_)));
    // Heads not a multiple of the kv heads; head dims that differ; values
    // unlike keys; empty sequences; sinks of the wrong length.
    assert!(shape_err(call([[1, 3, 4, 8], good, good], None, None, ok)));
    assert!(shape_err(call(
        [good, [1, 2, 4, 4], [1, 2, 4, 4]],
        None,
        None,
        ok
    )));
    assert!(shape_err(call([good, good, [1, 2, 5, 8]], None, None, ok)));
    assert!(shape_err(call([[1, 2, 0, 8], good, good], None, None, ok)));
    assert!(shape_err(call([good; 3], Some(3), None, ok)));
    assert!(shape_err(call([good; 3], None, Some(2), ok)));
    let config_err =
        |r: Result<Tensor<B, 4>, BastileError>| matches!(r, Err(BastileError::Config(_)));
    let zero_window = AttentionOptions {
        window: Some(0),
        ..ok
    };
    assert!(config_err(call([good; 3], None, None, zero_window)));
    let bad_scale = AttentionOptions {
        scale: Some(f64::NAN),
        ..ok
    };
    assert!(config_err(call([good; 3], None, None, bad_scale)));
    // Positions of the wrong shape; documents without the causal mask.
    let with_positions = |dims: [usize; 2], causal: bool| {
        let positions = Tensor::<B, 2, Int>::zeros(dims, &device);
        let options = AttentionOptions { causal, ..ok };
        attention(
            t(good),
            t(good),
            t(good),
            None,
            None,
            Some(positions),
            options,
        )
    };
    assert!(shape_err(with_positions([1, 5], true)));
    assert!(config_err(with_positions([1, 4], false)));
    assert!(with_positions([1, 4], true).is_ok());
}

#[test]
fn document_starts_follow_the_zeros_of_the_positions() {
    type B = burn::backend::NdArray;
    let device = Default::default();
    // A document starts where its place is 0 and at the row's start; ids
    // that do not count up by one change nothing else.
    let positions =
        Tensor::<B, 2, Int>::from_ints([[3, 0, 1, 2, 0, 5], [0, 1, 0, 0, 7, 8]], &device);
    let starts = bastile::document_starts(positions);
    assert_eq!(
        starts.into_data().convert::<i64>().to_vec::<i64>().unwrap(),
        vec![0, 1, 1, 1, 4, 4, 0, 0, 2, 3, 3, 3]
    );
}
