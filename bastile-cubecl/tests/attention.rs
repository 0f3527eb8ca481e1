//! Attention kernels against the f64 reference: output, log-sum-exp, dq,
//! dk, dv and the sink gradient, for every launch candidate, odd sequence
//! lengths, every mask option, GQA ratios 1–8, sequence-major (strided)
//! layouts and poisoned outputs.

use bastile_cubecl::attention::mma::{self, MmaLaunch};
use bastile_cubecl::attention::{
    self, AttentionBackwardBuffers, AttentionForwardBuffers, AttentionProblem, AttnLaunch,
    HeadLayout,
};
use bastile_cubecl::reference::attention::{self as reference, AttentionSpec};
use bastile_cubecl::testing::*;
use bastile_cubecl::{FloatDtype, KernelError};
use cubecl::prelude::*;

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
    /// Store q, k, v, dout as `[batch, seq, heads, head_dim]` (what a
    /// projection's reshape gives) instead of head-major.
    seq_major: bool,
    /// Queries lean one way and keys drift that way along the sequence,
    /// so a row's scores climb by about 30 from its first key to its last:
    /// its running maximum keeps moving mid-row.
    rising: bool,
}

impl Case {
    fn new(batch: usize, heads: usize, kv_heads: usize, seq: usize, head_dim: usize) -> Self {
        Case {
            batch,
            heads,
            kv_heads,
            seq_q: seq,
            seq_k: seq,
            head_dim,
            causal: true,
            window: None,
            sinks: false,
            key_lengths: None,
            documents: None,
            seq_major: false,
            rising: false,
        }
    }
}

/// `[batch, heads, seq, d]` values laid out as the case says, with their
/// layout.
fn place<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: FloatDtype,
    values: &[f64],
    dims: [usize; 4],
    sequence_major: bool,
) -> HeadLayout {
    let [_, h, s, d] = dims;
    if !sequence_major {
        return HeadLayout::dense(upload(client, dtype, values), h, s, d);
    }
    HeadLayout {
        handle: upload(client, dtype, &seq_major(values, dims)),
        strides: [s * h * d, d, h * d],
    }
}

fn poisoned_layout<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: FloatDtype,
    dims: [usize; 4],
) -> HeadLayout {
    let [b, h, s, d] = dims;
    HeadLayout::dense(poisoned(client, dtype, b * h * s * d), h, s, d)
}

impl Case {
    /// The document of every key position, `[batch, seq_k]`.
    fn document_ids(&self) -> Option<Vec<usize>> {
        let rows = self.documents.as_ref()?;
        let mut ids = Vec::with_capacity(self.batch * self.seq_k);
        for lengths in rows {
            let mut row: Vec<usize> = lengths
                .iter()
                .enumerate()
                .flat_map(|(doc, &n)| std::iter::repeat_n(doc, n))
                .collect();
            assert!(
                row.len() <= self.seq_k,
                "{lengths:?} overflow {}",
                self.seq_k
            );
            row.resize(self.seq_k, lengths.len());
            ids.extend(row);
        }
        Some(ids)
    }

    /// Where each key position's document starts, as the kernels take it.
    fn document_starts(&self) -> Option<Vec<i32>> {
        let ids = self.document_ids()?;
        let mut starts = vec![0i32; ids.len()];
        for (i, id) in ids.iter().enumerate() {
            let p = i % self.seq_k;
            starts[i] = if p > 0 && ids[i - 1] == *id {
                starts[i - 1]
            } else {
                p as i32
            };
        }
        Some(starts)
    }
}

fn round_all(dtype: FloatDtype, values: impl IntoIterator<Item = f64>) -> Vec<f64> {
    values.into_iter().map(|v| round_to(dtype, v)).collect()
}

/// Which kernels a check runs, with an explicit configuration or tuned.
#[derive(Clone, Copy, Debug)]
enum Path<'a> {
    Tiled(Option<&'a AttnLaunch>),
    /// The tensor-core kernels: forward and backward configurations.
    Mma(Option<(&'a MmaLaunch, &'a MmaLaunch)>),
    /// cuDNN's fused attention (CUDA only).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Cudnn,
}

fn check<R: Runtime>(
    client: &ComputeClient<R>,
    device: &R::Device,
    case: &Case,
    dtype: FloatDtype,
    config: Path,
    rng: &mut Rng,
) {
    let seed = rng.seed();
    let what = format!("{case:?} {dtype} {config:?} seed {seed}");
    let c = case;
    let scale = 1.0 / (c.head_dim as f64).sqrt();
    let q_dims = [c.batch, c.heads, c.seq_q, c.head_dim];
    let k_dims = [c.batch, c.kv_heads, c.seq_k, c.head_dim];
    let n_q = c.batch * c.heads * c.seq_q * c.head_dim;
    let n_k = c.batch * c.kv_heads * c.seq_k * c.head_dim;
    // Scores of a few units: softmaxes that are neither flat nor one-hot.
    let (q, k) = if c.rising {
        let q = round_all(dtype, rng.normals(n_q, 1.0, 1.5));
        // Key j leans 2.7·j/seq_k along every dim: scores rise by about
        // 2.7·√d over the sequence.
        let k = rng
            .normals(n_k, 0.0, 1.5)
            .into_iter()
            .enumerate()
            .map(|(i, v)| v + 2.7 * ((i / c.head_dim) % c.seq_k) as f64 / c.seq_k as f64);
        (q, round_all(dtype, k))
    } else {
        (rounded(rng, dtype, n_q, 1.5), rounded(rng, dtype, n_k, 1.5))
    };
    let v = rounded(rng, dtype, n_k, 1.0);
    let dout = rounded(rng, dtype, n_q, 1.0);
    let sinks: Vec<f64> = rng.normals(c.heads, 1.0, 1.0);
    let spec = AttentionSpec {
        batch: c.batch,
        heads: c.heads,
        kv_heads: c.kv_heads,
        seq_q: c.seq_q,
        seq_k: c.seq_k,
        head_dim: c.head_dim,
        scale,
        causal: c.causal,
        window: c.window,
        key_lengths: c.key_lengths.clone(),
        documents: c.document_ids(),
        sinks: c.sinks.then(|| sinks.clone()),
    };
    let (out_ref, lse_ref) = reference::forward(&spec, &q, &k, &v);

    let problem = problem_of(c, dtype);
    let rows = problem.query_rows();
    let sinks_h = c.sinks.then(|| upload(client, FloatDtype::F32, &sinks));
    let lengths_h = c.key_lengths.as_ref().map(|l| {
        let lengths: Vec<i32> = l.iter().map(|&n| n as i32).collect();
        upload_i32(client, &lengths)
    });
    let starts_h = c.document_starts().map(|s| upload_i32(client, &s));
    let fwd = AttentionForwardBuffers {
        q: place(client, dtype, &q, q_dims, c.seq_major),
        k: place(client, dtype, &k, k_dims, c.seq_major),
        v: place(client, dtype, &v, k_dims, c.seq_major),
        out: poisoned_layout(client, dtype, q_dims),
        lse: poisoned(client, FloatDtype::F32, rows),
        sinks: sinks_h.clone(),
        key_lengths: lengths_h.clone(),
        doc_starts: starts_h.clone(),
    };
    match config {
        Path::Tiled(Some(cfg)) => attention::forward_with(client, &problem, &fwd, cfg).unwrap(),
        Path::Tiled(None) => attention::forward(client, device, &problem, &fwd).unwrap(),
        Path::Mma(Some((cfg, _))) => mma::forward_with(client, &problem, &fwd, cfg).unwrap(),
        Path::Mma(None) => mma::forward(client, device, &problem, &fwd).unwrap(),
        Path::Cudnn => cudnn::forward(client, device, &problem, &fwd),
    }
    let out = download(client, dtype, fwd.out.handle.clone());
    cudnn::no_errors(&what);
    assert_close(
        &format!("out {what}"),
        &out,
        &out_ref,
        tolerance(dtype),
        seed,
    );
    let lse = download(client, FloatDtype::F32, fwd.lse.clone());
    for (i, (&a, &e)) in lse.iter().zip(&lse_ref).enumerate() {
        if e.is_finite() {
            assert!(
                (a - e).abs() <= 1e-4 * (1.0 + e.abs()),
                "lse {what}: row {i} is {a}, expected {e}"
            );
        }
    }

    let bwd = AttentionBackwardBuffers {
        q: fwd.q.clone(),
        k: fwd.k.clone(),
        v: fwd.v.clone(),
        out: fwd.out.clone(),
        dout: place(client, dtype, &dout, q_dims, c.seq_major),
        lse: fwd.lse.clone(),
        sinks: sinks_h,
        key_lengths: lengths_h,
        doc_starts: starts_h,
        dq: poisoned_layout(client, dtype, q_dims),
        dk: poisoned_layout(client, dtype, k_dims),
        dv: poisoned_layout(client, dtype, k_dims),
        delta: poisoned(client, FloatDtype::F32, rows),
        dsink_rows: c.sinks.then(|| poisoned(client, FloatDtype::F32, rows)),
    };
    match config {
        Path::Tiled(Some(cfg)) => attention::backward_with(client, &problem, &bwd, cfg).unwrap(),
        Path::Tiled(None) => attention::backward(client, device, &problem, &bwd).unwrap(),
        Path::Mma(Some((_, cfg))) => mma::backward_with(client, &problem, &bwd, cfg).unwrap(),
        Path::Mma(None) => mma::backward(client, device, &problem, &bwd).unwrap(),
        Path::Cudnn => cudnn::backward(client, device, &problem, &bwd),
    }
    // The backward reads the kernel's own output (rounded to the dtype), and
    // so does the reference's Δ.
    let grads_ref = reference::backward(&spec, &q, &k, &v, &out, &dout);
    let tol = tolerance(dtype) * if dtype == FloatDtype::F32 { 4.0 } else { 1.0 };
    for (name, h, expected) in [
        ("dq", &bwd.dq, &grads_ref.dq),
        ("dk", &bwd.dk, &grads_ref.dk),
        ("dv", &bwd.dv, &grads_ref.dv),
    ] {
        let got = download(client, dtype, h.handle.clone());
        cudnn::no_errors(&what);
        if expected.iter().all(|e| e.abs() < 1e-12) {
            // A gradient that is zero (one visible key: dS = P·(dP − Δ)
            // with P = 1 and dP = Δ) has no scale of its own to be
            // relative to: it must be zero up to rounding of O(1) terms.
            let worst = got.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            assert!(
                worst <= tol,
                "{name} {what}: expected zeros, got up to {worst:e}"
            );
        } else {
            assert_close(&format!("{name} {what}"), &got, expected, tol, seed);
        }
    }
    if let Some(rows_h) = &bwd.dsink_rows {
        let per_row = download(client, FloatDtype::F32, rows_h.clone());
        let mut dsinks = vec![0.0; c.heads];
        for (r, v) in per_row.iter().enumerate() {
            dsinks[r / c.seq_q % c.heads] += v;
        }
        assert_close(
            &format!("dsinks {what}"),
            &dsinks,
            &grads_ref.dsinks,
            tol,
            seed,
        );
    }
}

struct EveryCandidate;

impl RuntimeTest for EveryCandidate {
    fn run<R: Runtime>(&self, device: &R::Device, runtime: &str, dtypes: &[FloatDtype]) {
        let client = R::client(device);
        let mut rng = Rng::fresh();
        // Off CUDA a configuration checked in one dtype is not checked again
        // in the next (the kernels are generic over it; every dtype runs
        // every mask option below).
        let mut checked: Vec<AttnLaunch> = Vec::new();
        for dtype in supported_dtypes(&client, dtypes) {
            let mut case = Case::new(2, 4, 2, 37, 64);
            case.sinks = true;
            let fwd = attention::candidates(&client, &problem_of(&case, dtype), false);
            let bwd = attention::candidates(&client, &problem_of(&case, dtype), true);
            assert!(
                fwd.len() >= 4 && bwd.len() >= 2,
                "{runtime}: {fwd:?} {bwd:?}"
            );
            // Each forward candidate once; the backward ones take turns.
            for (i, cfg) in fwd.iter().enumerate() {
                if !thorough(runtime) && checked.contains(cfg) {
                    continue;
                }
                checked.push(*cfg);
                let cfg = if bwd.contains(cfg) {
                    cfg
                } else {
                    &bwd[i % bwd.len()]
                };
                check(
                    &client,
                    device,
                    &case,
                    dtype,
                    Path::Tiled(Some(cfg)),
                    &mut rng,
                );
            }
        }
    }
}

#[test]
fn attention_every_candidate_matches_reference() {
    for_each_runtime(&EveryCandidate);
}

/// Every mask option, GQA ratio, odd length, head dim and layout.
fn option_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for (seq, ratio) in [(1usize, 1usize), (7, 2), (129, 4), (65, 8)] {
        let mut c = Case::new(1, 8, 8 / ratio, seq, 64);
        c.causal = seq % 2 == 1;
        cases.push(c);
    }
    let mut window = Case::new(2, 4, 2, 150, 64);
    window.window = Some(20);
    window.sinks = true;
    cases.push(window.clone());
    window.window = Some(1);
    window.sinks = false;
    cases.push(window);
    let mut padded = Case::new(3, 2, 1, 45, 80);
    padded.key_lengths = Some(vec![45, 17, 0]);
    padded.sinks = true;
    cases.push(padded.clone());
    padded.sinks = false;
    cases.push(padded);
    let mut strided = Case::new(2, 4, 4, 33, 128);
    strided.seq_major = true;
    strided.causal = false;
    cases.push(strided.clone());
    strided.causal = true;
    strided.seq_k = 50;
    cases.push(strided);
    let mut rising = Case::new(1, 4, 2, 300, 128);
    rising.rising = true;
    cases.push(rising);
    let mut cross = Case::new(1, 2, 1, 9, 64);
    cross.causal = false;
    cross.seq_k = 4;
    cases.push(cross);
    cases.extend(packed_cases());
    cases
}

/// Rows packing several documents: documents of one position, odd
/// lengths, one document filling its row, and documents under a window,
/// sinks and padding at once.
fn packed_cases() -> Vec<Case> {
    let mut packed = Case::new(3, 4, 2, 70, 64);
    packed.documents = Some(vec![vec![1, 1, 33, 35], vec![70], vec![17, 1, 1, 40]]);
    let mut everything = Case::new(2, 4, 1, 150, 64);
    everything.documents = Some(vec![vec![50, 3, 60], vec![1, 148]]);
    everything.window = Some(20);
    everything.sinks = true;
    everything.key_lengths = Some(vec![150, 120]);
    vec![packed, everything]
}

struct Options;

impl RuntimeTest for Options {
    fn run<R: Runtime>(&self, device: &R::Device, runtime: &str, dtypes: &[FloatDtype]) {
        let client = R::client(device);
        let mut rng = Rng::fresh();
        let cases = option_cases();
        let dtypes = supported_dtypes(&client, dtypes);
        for (d, &dtype) in dtypes.iter().enumerate() {
            for (i, case) in cases.iter().enumerate() {
                // Off CUDA the dtypes take turns over the cases: every mask
                // option and every dtype is still checked.
                if !takes_turn(i, d, dtypes.len(), thorough(runtime)) {
                    continue;
                }
                // Rotate through the launch candidates of the problem.
                let list = attention::candidates(&client, &problem_of(case, dtype), true);
                check(
                    &client,
                    device,
                    case,
                    dtype,
                    Path::Tiled(Some(&list[i % list.len()])),
                    &mut rng,
                );
            }
        }
    }
}

#[test]
fn attention_masks_gqa_sinks_padding_and_layouts_match_reference() {
    for_each_runtime(&Options);
}

/// Inputs on which the sink gradient (a sum of `p_sink·Δ` over a head's
/// rows) missed f16's bound, 2.02e-3 against 2e-3, while the reference's
/// `Δ` read the exact output: rounding the stored output to f16 moved every
/// row's `Δ`. With the stored output, which the kernels read, the error is
/// under 1e-6.
struct CancellingSinkGradient;

impl RuntimeTest for CancellingSinkGradient {
    fn run<R: Runtime>(&self, device: &R::Device, _runtime: &str, dtypes: &[FloatDtype]) {
        let client = R::client(device);
        let mut case = Case::new(3, 2, 1, 45, 80);
        case.key_lengths = Some(vec![45, 17, 0]);
        case.sinks = true;
        let cfg = AttnLaunch {
            rows: 16,
            cols: 16,
            upr: 4,
        };
        for dtype in supported_dtypes(&client, dtypes) {
            let mut rng = Rng::from_seed(6756962980603784574);
            check(
                &client,
                device,
                &case,
                dtype,
                Path::Tiled(Some(&cfg)),
                &mut rng,
            );
        }
    }
}

#[test]
fn attention_sink_gradient_survives_cancelling_rows() {
    for_each_runtime(&CancellingSinkGradient);
}

struct Tuned;

impl RuntimeTest for Tuned {
    fn run<R: Runtime>(&self, device: &R::Device, runtime: &str, dtypes: &[FloatDtype]) {
        let client = R::client(device);
        let mut rng = Rng::fresh();
        let seq = if runtime == "cuda" { 1000 } else { 300 };
        for dtype in supported_dtypes(&client, dtypes) {
            let mut case = Case::new(1, 4, 2, seq, 64);
            case.sinks = true;
            check(&client, device, &case, dtype, Path::Tiled(None), &mut rng);
        }
    }
}

#[test]
fn attention_autotuned_matches_reference_on_long_sequences() {
    for_each_runtime(&Tuned);
}

struct Rejects;

impl RuntimeTest for Rejects {
    fn run<R: Runtime>(&self, device: &R::Device, _runtime: &str, _dtypes: &[FloatDtype]) {
        let client = R::client(device);
        let layout = || HeadLayout::dense(client.empty(4096), 2, 4, 64);
        let buffers = AttentionForwardBuffers {
            q: layout(),
            k: layout(),
            v: layout(),
            out: layout(),
            lse: client.empty(64),
            sinks: None,
            key_lengths: None,
            doc_starts: None,
        };
        let base = AttentionProblem {
            batch: 1,
            heads: 2,
            kv_heads: 2,
            seq_q: 4,
            seq_k: 4,
            head_dim: 64,
            scale: 0.125,
            causal: true,
            window: None,
            sinks: false,
            key_lengths: false,
            documents: false,
            dtype: FloatDtype::F32,
        };
        for bad in [
            // Documents end at the query only under the causal mask.
            AttentionProblem {
                documents: true,
                causal: false,
                ..base
            },
            // Documents, sinks or key lengths named with no buffer.
            AttentionProblem {
                documents: true,
                ..base
            },
            AttentionProblem {
                sinks: true,
                ..base
            },
            AttentionProblem {
                key_lengths: true,
                ..base
            },
            AttentionProblem {
                kv_heads: 3,
                ..base
            },
            AttentionProblem { seq_q: 0, ..base },
            AttentionProblem { seq_k: 3, ..base },
            AttentionProblem {
                window: Some(0),
                ..base
            },
            AttentionProblem {
                scale: f32::NAN,
                ..base
            },
        ] {
            let err = attention::forward(&client, device, &bad, &buffers).unwrap_err();
            assert!(matches!(err, KernelError::Shape(_)), "{bad:?}: {err}");
        }
        // A head dim no tiling divides is refused, not launched.
        let odd = AttentionProblem {
            head_dim: 63,
            ..base
        };
        assert!(attention::candidates(&client, &odd, false).is_empty());
        let err = attention::forward(&client, device, &odd, &buffers).unwrap_err();
        assert!(matches!(err, KernelError::Unsupported(_)), "{err}");
    }
}

#[test]
fn attention_rejects_bad_problems() {
    for_each_runtime(&Rejects);
}

/// The kernels' problem for a case: its shape and options in `dtype`, the
/// score scale `1/√d` the reference uses.
fn problem_of(c: &Case, dtype: FloatDtype) -> AttentionProblem {
    AttentionProblem {
        batch: c.batch,
        heads: c.heads,
        kv_heads: c.kv_heads,
        seq_q: c.seq_q,
        seq_k: c.seq_k,
        head_dim: c.head_dim,
        scale: (1.0 / (c.head_dim as f64).sqrt()) as f32,
        causal: c.causal,
        window: c.window,
        sinks: c.sinks,
        key_lengths: c.key_lengths.is_some(),
        documents: c.documents.is_some(),
        dtype,
    }
}

/// The half-precision dtypes the tensor-core path runs on this client (it
/// decides per dtype, whatever the problem's options), or, where it runs
/// none, checks that a launch is refused and gives none.
fn tensor_core_dtypes<R: Runtime>(
    client: &ComputeClient<R>,
    runtime: &str,
    dtypes: &[FloatDtype],
) -> Vec<FloatDtype> {
    let mut candidate = Case::new(2, 4, 2, 37, 64);
    candidate.sinks = true;
    let half: Vec<FloatDtype> = supported_dtypes(client, dtypes)
        .into_iter()
        .filter(|d| *d != FloatDtype::F32)
        .filter(|d| mma::usable(client, &problem_of(&candidate, *d)))
        .collect();
    if half.is_empty() {
        // Without the instruction (or in f32) the path refuses, it
        // never launches.
        let problem = problem_of(&candidate, FloatDtype::F32);
        let layout = || HeadLayout::dense(client.empty(1 << 16), 4, 37, 64);
        let buffers = AttentionForwardBuffers {
            q: layout(),
            k: layout(),
            v: layout(),
            out: layout(),
            lse: client.empty(1024),
            sinks: None,
            key_lengths: None,
            doc_starts: None,
        };
        let cfg = MmaLaunch {
            planes: 4,
            cols: 64,
            tiles: 1,
            fused_dq: false,
        };
        let err = mma::forward_with(client, &problem, &buffers, &cfg).unwrap_err();
        assert!(
            matches!(err, KernelError::Unsupported(_)),
            "{runtime}: {err}"
        );
    }
    half
}

/// Every launch candidate of the tensor-core path, forward and backward
/// in turns, in each half dtype.
struct TensorCoreCandidates;

impl RuntimeTest for TensorCoreCandidates {
    fn run<R: Runtime>(&self, device: &R::Device, runtime: &str, dtypes: &[FloatDtype]) {
        let client = R::client(device);
        let mut rng = Rng::fresh();
        let mut candidate = Case::new(2, 4, 2, 37, 64);
        candidate.sinks = true;
        for dtype in tensor_core_dtypes(&client, runtime, dtypes) {
            let fwd = mma::candidates(&client, &problem_of(&candidate, dtype), false);
            let bwd = mma::candidates(&client, &problem_of(&candidate, dtype), true);
            assert!(fwd.len() >= 3 && bwd.len() >= 3, "{fwd:?} {bwd:?}");
            let pair = |i: usize| Path::Mma(Some((&fwd[i % fwd.len()], &bwd[i % bwd.len()])));
            for i in 0..fwd.len().max(bwd.len()) {
                check(&client, device, &candidate, dtype, pair(i), &mut rng);
            }
        }
    }
}

/// The tensor-core path under every mask option, padding under the fused
/// backward, and a long case with the tuned (or default) launches. The
/// kernels are generic over the dtype: one is enough.
struct TensorCoreOptions;

impl RuntimeTest for TensorCoreOptions {
    fn run<R: Runtime>(&self, device: &R::Device, runtime: &str, dtypes: &[FloatDtype]) {
        let client = R::client(device);
        let mut rng = Rng::fresh();
        let half = tensor_core_dtypes(&client, runtime, dtypes);
        let Some(&dtype) = half
            .iter()
            .find(|d| **d != FloatDtype::F16)
            .or(half.first())
        else {
            return;
        };
        // Each option case rotates through its own candidates (the fused
        // backward takes only some head dims).
        for (i, case) in option_cases().iter().enumerate() {
            let fwd = mma::candidates(&client, &problem_of(case, dtype), false);
            let bwd = mma::candidates(&client, &problem_of(case, dtype), true);
            let path = Path::Mma(Some((&fwd[i % fwd.len()], &bwd[i % bwd.len()])));
            check(&client, device, case, dtype, path, &mut rng);
        }
        // Padding under the fused backward, where the device has it.
        let mut padded = Case::new(3, 4, 2, 45, 128);
        padded.key_lengths = Some(vec![45, 17, 0]);
        padded.causal = true;
        let problem = problem_of(&padded, dtype);
        let fwd = mma::candidates(&client, &problem, false);
        let fused = mma::candidates(&client, &problem, true)
            .into_iter()
            .filter(|c| c.fused_dq);
        for (i, bwd) in fused.enumerate() {
            let path = Path::Mma(Some((&fwd[i % fwd.len()], &bwd)));
            check(&client, device, &padded, dtype, path, &mut rng);
        }
        let mut long = Case::new(1, 4, 2, 1000, 128);
        long.sinks = true;
        check(&client, device, &long, dtype, Path::Mma(None), &mut rng);
    }
}

#[test]
fn attention_tensor_core_candidates_match_reference() {
    for_each_runtime(&TensorCoreCandidates);
}

#[test]
fn attention_tensor_core_options_match_reference() {
    for_each_runtime(&TensorCoreOptions);
}

/// Launching cuDNN's attention from the generic checks: the CUDA client
/// and device behind `R`, and the errors met on CubeCL's device thread.
#[cfg(feature = "cuda")]
mod cudnn {
    use std::any::Any;
    use std::sync::Mutex;

    use bastile_cubecl::attention::{
        AttentionBackwardBuffers, AttentionForwardBuffers, AttentionProblem, cudnn,
    };
    use cubecl::cuda::{CudaDevice, CudaRuntime};
    use cubecl::prelude::*;

    static ERRORS: Mutex<Vec<String>> = Mutex::new(Vec::new());

    fn record(e: bastile_cubecl::KernelError) {
        ERRORS.lock().unwrap().push(e.to_string());
    }

    pub fn cuda<'a, R: Runtime>(
        client: &'a ComputeClient<R>,
        device: &R::Device,
    ) -> Option<(&'a ComputeClient<CudaRuntime>, usize)> {
        let index = (device as &dyn Any).downcast_ref::<CudaDevice>()?.index;
        let client = (client as &dyn Any).downcast_ref::<ComputeClient<CudaRuntime>>()?;
        Some((client, index))
    }

    pub fn forward<R: Runtime>(
        client: &ComputeClient<R>,
        device: &R::Device,
        problem: &AttentionProblem,
        buffers: &AttentionForwardBuffers,
    ) {
        let (client, index) = cuda(client, device).expect("cuDNN checks run on CUDA");
        cudnn::forward(client, index, problem, buffers, record).unwrap();
    }

    pub fn backward<R: Runtime>(
        client: &ComputeClient<R>,
        device: &R::Device,
        problem: &AttentionProblem,
        buffers: &AttentionBackwardBuffers,
    ) {
        let (client, index) = cuda(client, device).expect("cuDNN checks run on CUDA");
        cudnn::backward(client, index, problem, buffers, record).unwrap();
    }

    /// Panics with the errors cuDNN's calls met since the last check.
    pub fn no_errors(what: &str) {
        let errors = std::mem::take(&mut *ERRORS.lock().unwrap());
        assert!(errors.is_empty(), "cuDNN {what}: {errors:?}");
    }
}

#[cfg(not(feature = "cuda"))]
mod cudnn {
    use bastile_cubecl::attention::{
        AttentionBackwardBuffers, AttentionForwardBuffers, AttentionProblem,
    };
    use cubecl::prelude::*;

    pub fn forward<R: Runtime>(
        _: &ComputeClient<R>,
        _: &R::Device,
        _: &AttentionProblem,
        _: &AttentionForwardBuffers,
    ) {
        unreachable!("cuDNN checks run on CUDA");
    }

    pub fn backward<R: Runtime>(
        _: &ComputeClient<R>,
        _: &R::Device,
        _: &AttentionProblem,
        _: &AttentionBackwardBuffers,
    ) {
        unreachable!("cuDNN checks run on CUDA");
    }

    pub fn no_errors(_: &str) {}
}

/// cuDNN's fused attention, where it is loaded, against the f64 reference:
/// every option case its graphs take, head dims 64 to 256 and odd
/// lengths up to 4097, GQA ratios 1 to 8, causal and not, strided
/// layouts, in each half dtype. Elsewhere it must refuse.
#[cfg(feature = "cuda")]
struct Cudnn;

#[cfg(feature = "cuda")]
impl RuntimeTest for Cudnn {
    fn run<R: Runtime>(&self, device: &R::Device, runtime: &str, dtypes: &[FloatDtype]) {
        use bastile_cubecl::attention::cudnn as fused;
        let client = R::client(device);
        let Some((_, index)) = cudnn::cuda(&client, device) else {
            return;
        };
        if !bastile_cubecl::cudnn::available(index) {
            eprintln!("{runtime}: cuDNN is not loaded; its attention is not checked");
            return;
        }
        let mut cases: Vec<Case> = option_cases()
            .into_iter()
            .filter(|c| fused::takes(&problem_of(c, FloatDtype::BF16)))
            .collect();
        for (heads, kv_heads, seq, d) in [
            (4, 4, 100, 64),
            (4, 2, 63, 80),
            (2, 1, 1000, 96),
            (2, 1, 70, 256),
        ] {
            cases.push(Case::new(1, heads, kv_heads, seq, d));
        }
        cases.push(Case::new(1, 4, 1, 4097, 64));
        assert!(cases.len() >= 10, "{cases:?}");
        let mut rng = Rng::fresh();
        for dtype in supported_dtypes(&client, dtypes)
            .into_iter()
            .filter(|d| *d != FloatDtype::F32)
        {
            for case in &cases {
                check(&client, device, case, dtype, Path::Cudnn, &mut rng);
            }
        }
        // What the graphs do not express is refused before any launch.
        let mut window = Case::new(1, 2, 1, 64, 64);
        window.window = Some(8);
        assert!(!fused::takes(&problem_of(&window, FloatDtype::BF16)));
        assert!(!fused::takes(&problem_of(
            &Case::new(1, 2, 1, 64, 64),
            FloatDtype::F32
        )));
    }
}

#[cfg(feature = "cuda")]
#[test]
fn attention_cudnn_matches_reference() {
    for_each_runtime(&Cudnn);
}
