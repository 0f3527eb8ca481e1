//! Fused linear cross-entropy and cross-entropy through Burn: `Bastile<B>`
//! (chunked kernels) and `B` (composite) under `Autodiff`, against an f64
//! reference, for every option and reduction, odd shapes, chunk remainders,
//! ignored and all-ignored tokens; the drop-in and module wrappers; errors.

use crate::common::*;
use bastile::nn::{CrossEntropyLossConfig, LinearCrossEntropyLossConfig};
use bastile::{
    Bastile, BastileBackend, BastileError, CrossEntropyOptions, Reduction, WeightGradSum,
    cross_entropy, linear_cross_entropy,
};
use bastile_cubecl::reference::cross_entropy::{self as reference, Options};
use bastile_cubecl::testing::{Rng, assert_close, assert_close_to_magnitude, round_to};
use burn::backend::Autodiff;
use burn::tensor::{DType, Int, Tensor, TensorData};

/// A problem: `n` tokens of `h` features, `v` classes.
#[derive(Clone, Copy, Debug)]
struct Shape {
    n: usize,
    h: usize,
    v: usize,
    bias: bool,
}

/// Inputs as f64 values already rounded to the dtype.
struct Inputs {
    hidden: Vec<f64>,
    weight: Vec<f64>,
    bias: Vec<f64>,
    labels: Vec<i64>,
    /// The upstream gradient of the loss: one value, or one per token.
    upstream: Vec<f64>,
}

fn inputs(rng: &mut Rng, s: Shape, dtype: DType, ignore: i64, every: usize, none: bool) -> Inputs {
    let labels = (0..s.n)
        .map(|i| {
            if every > 0 && i % every == 1 {
                ignore
            } else {
                (rng.next_u64() % s.v as u64) as i64
            }
        })
        .collect();
    Inputs {
        hidden: randn(rng, s.n * s.h, 0.0, 1.0, dtype),
        weight: randn(rng, s.v * s.h, 0.0, 2.0 / (s.h as f64).sqrt(), dtype),
        bias: randn(rng, s.v, 0.0, 0.5, dtype),
        labels,
        upstream: if none {
            rng.normals(s.n, 0.0, 1.0)
        } else {
            vec![1.75]
        },
    }
}

/// What a run produces, as f64.
#[derive(Debug)]
struct Results {
    loss: Vec<f64>,
    lse: Vec<f64>,
    z_loss: Option<Vec<f64>>,
    dh: Vec<f64>,
    dw: Vec<f64>,
    db: Vec<f64>,
}

fn options_of(o: &CrossEntropyOptions) -> Options {
    Options {
        ignore_index: o.ignore_index,
        label_smoothing: o.label_smoothing,
        z_loss: o.z_loss,
        softcap: o.softcap,
    }
}

/// The f64 reference: logits rounded to the dtype as the matmul stores
/// them, per-row losses and gradients, the gradient rounded where the
/// fused and composite paths store it.
fn expected(x: &Inputs, s: Shape, o: &CrossEntropyOptions, dtype: DType) -> Results {
    let round = |v: f64| round_to(kdtype(dtype), v);
    let mut logits = vec![0.0; s.n * s.v];
    for t in 0..s.n {
        for c in 0..s.v {
            let dot: f64 = (0..s.h)
                .map(|k| x.hidden[t * s.h + k] * x.weight[c * s.h + k])
                .sum();
            let mut z = round(dot);
            if s.bias {
                z = round(z + x.bias[c]);
            }
            logits[t * s.v + c] = z;
        }
    }
    let rows = reference::rows(&logits, s.v, &x.labels, &options_of(o));
    let counted = x.labels.iter().filter(|&&l| l != o.ignore_index).count();
    let scale = match o.reduction {
        Reduction::Mean => 1.0 / o.normalizer.unwrap_or(counted.max(1) as f64),
        _ => 1.0,
    };
    let up = |t: usize| x.upstream[if x.upstream.len() == 1 { 0 } else { t }];
    let losses: Vec<f64> = rows.iter().map(|r| r.loss).collect();
    let zs: Vec<f64> = rows
        .iter()
        .zip(&x.labels)
        .map(|(r, &l)| {
            if l == o.ignore_index {
                0.0
            } else {
                o.z_loss * r.lse * r.lse
            }
        })
        .collect();
    let reduce = |v: &[f64]| match o.reduction {
        Reduction::None => v.to_vec(),
        _ => vec![v.iter().sum::<f64>() * scale],
    };
    let dlogits: Vec<f64> = rows
        .iter()
        .enumerate()
        .flat_map(|(t, r)| r.grad.iter().map(move |g| round(g * scale * up(t))))
        .collect();
    let mut dh = vec![0.0; s.n * s.h];
    let mut dw = vec![0.0; s.v * s.h];
    let mut db = vec![0.0; s.v];
    for t in 0..s.n {
        for c in 0..s.v {
            let d = dlogits[t * s.v + c];
            if d == 0.0 {
                continue;
            }
            db[c] += d;
            for k in 0..s.h {
                dh[t * s.h + k] += d * x.weight[c * s.h + k];
                dw[c * s.h + k] += d * x.hidden[t * s.h + k];
            }
        }
    }
    Results {
        loss: reduce(&losses),
        lse: rows.iter().map(|r| r.lse).collect(),
        z_loss: (o.z_loss > 0.0).then(|| reduce(&zs)),
        dh: dh.into_iter().map(round).collect(),
        dw: dw.into_iter().map(round).collect(),
        db: if s.bias {
            db.into_iter().map(round).collect()
        } else {
            vec![]
        },
    }
}

fn labels_tensor<X: BastileBackend>(labels: &[i64], device: &X::Device) -> Tensor<X, 1, Int> {
    Tensor::from_data(TensorData::new(labels.to_vec(), [labels.len()]), device)
}

/// Runs the fused linear cross-entropy on `Autodiff<X>` and backpropagates
/// `upstream · loss`.
fn run_linear<X: BastileBackend>(
    x: &Inputs,
    s: Shape,
    o: CrossEntropyOptions,
    dtype: DType,
    device: &X::Device,
) -> Results {
    type A<X> = Autodiff<X>;
    let h = tensor::<A<X>, 2>(&x.hidden, [s.n, s.h], dtype, device).require_grad();
    let w = tensor::<A<X>, 2>(&x.weight, [s.v, s.h], dtype, device).require_grad();
    let b = s
        .bias
        .then(|| tensor::<A<X>, 1>(&x.bias, [s.v], dtype, device).require_grad());
    let out = linear_cross_entropy(
        h.clone(),
        w.clone(),
        b.clone(),
        labels_tensor::<A<X>>(&x.labels, device),
        o,
    )
    .unwrap();
    let up = tensor::<A<X>, 1>(&x.upstream, [x.upstream.len()], DType::F32, device);
    let grads = (out.loss.clone() * up).sum().backward();
    Results {
        loss: values(out.loss.inner()),
        lse: values(out.lse.inner()),
        z_loss: out.z_loss.map(|z| values(z.inner())),
        dh: values(h.grad(&grads).expect("dh")),
        dw: values(w.grad(&grads).expect("dw")),
        db: b
            .map(|b| values(b.grad(&grads).expect("db")))
            .unwrap_or_default(),
    }
}

/// Bounds for results that went through a matmul of `dtype` (CUDA runs
/// f32 matmuls in TF32).
fn matmul_tol(dtype: DType, name: &str) -> f64 {
    match dtype {
        DType::F32 if name.starts_with("cuda") => 3e-3,
        DType::F32 => 5e-5,
        DType::F16 => 5e-3,
        _ => 3e-2,
    }
}

fn compare(what: &str, got: &Results, exp: &Results, tol: f64, seed: u64) {
    assert_close(&format!("loss {what}"), &got.loss, &exp.loss, tol, seed);
    assert_close(&format!("lse {what}"), &got.lse, &exp.lse, tol, seed);
    match (&got.z_loss, &exp.z_loss) {
        (Some(g), Some(e)) => assert_close(&format!("z_loss {what}"), g, e, tol, seed),
        (None, None) => {}
        (g, e) => panic!("z_loss {what}: got {g:?}, expected {e:?}"),
    }
    for (name, g, e) in [
        ("dh", &got.dh, &exp.dh),
        ("dw", &got.dw, &exp.dw),
        ("db", &got.db, &exp.db),
    ] {
        if e.iter().all(|v| *v == 0.0) {
            assert!(
                g.iter().all(|v| *v == 0.0),
                "{name} {what}: expected exact zeros, got {:?}",
                &g[..g.len().min(8)]
            );
        } else {
            let what = format!("{name} {what} seed {seed}");
            assert_close_to_magnitude(&what, g, e, tol * 2.0);
        }
    }
}

backend_test! {
    /// Every option and reduction, fused and composite, against the reference.
    fn fused_linear_cross_entropy_matches_reference_for_every_option<B>(device, name, dtypes) {
        let mut rng = Rng::fresh();
        let seed = rng.seed();
        let base = CrossEntropyOptions::default().with_chunk_size(16);
        let cases = [
            (base, true, 4),
            // The weight's gradient from a second pass over vocabulary
            // slices rather than summed over the chunks (the default).
            (
                base.with_reduction(Reduction::Sum)
                    .with_weight_grad_sum(WeightGradSum::Exact),
                false,
                3,
            ),
            (base.with_reduction(Reduction::None), true, 5),
            // One chunk for all 37 tokens: the weight gradient comes from a
            // single product, with no accumulation across chunks.
            (base.with_chunk_size(64).with_label_smoothing(0.1), false, 0),
            (
                base.with_z_loss(1e-2)
                    .with_normalizer(50.0)
                    .with_weight_grad_sum(WeightGradSum::Exact),
                true,
                2,
            ),
            (base.with_softcap(2.0), false, 6),
            (
                base.with_ignore_index(3)
                    .with_label_smoothing(0.05)
                    .with_z_loss(1e-3)
                    .with_softcap(4.0)
                    .with_reduction(Reduction::None),
                true,
                4,
            ),
        ];
        for (d, &dtype) in dtypes.iter().enumerate() {
            let op = bastile::ops::linear_cross_entropy::LinearCrossEntropy {
                spec: bastile::ops::cross_entropy::LossSpec::probe(),
            };
            let query = bastile::ops::cross_entropy::CrossEntropyQuery { dtype };
            assert!(bastile::fused::is_fused::<Bastile<B>, _>(
                &op, device, &query
            ));
            for (i, &(o, bias, every)) in cases.iter().enumerate() {
                if !takes_turn(name, i, d, dtypes.len()) {
                    continue;
                }
                let s = Shape {
                    n: 37,
                    h: 64,
                    v: if i % 2 == 0 { 1000 } else { 1003 },
                    bias,
                };
                let none = o.reduction == Reduction::None;
                let x = inputs(&mut rng, s, dtype, o.ignore_index, every, none);
                let exp = expected(&x, s, &o, dtype);
                let tol = matmul_tol(dtype, name);
                let what = format!("{name} {dtype:?} {s:?} {o:?}");
                eprintln!("case {what}");
                let fused = run_linear::<Bastile<B>>(&x, s, o, dtype, device);
                compare(&format!("fused {what}"), &fused, &exp, tol, seed);
                if checks_composite(name) {
                    let composite = run_linear::<B>(&x, s, o, dtype, device);
                    compare(&format!("composite {what}"), &composite, &exp, tol, seed);
                }
            }
        }
    }
}

backend_test! {
    /// Model-sized vocabularies with an uneven last chunk, and every token
    /// ignored (loss 0, zero gradients, no NaN).
    fn fused_linear_cross_entropy_handles_large_vocabularies_and_all_ignored<B>(device, name, dtypes) {
        let mut rng = Rng::fresh();
        let seed = rng.seed();
        for (d, &dtype) in dtypes.iter().enumerate() {
            for (i, (n, h, v, chunk)) in [(5usize, 32usize, 50257usize, 2usize), (9, 16, 151936, 4)]
                .into_iter()
                .enumerate()
            {
                // Off CUDA each vocabulary once per backend, the dtypes
                // taking turns (and swapping between the two backends).
                let turn = i + usize::from(name.contains("fusion"));
                if !takes_turn(name, turn, d, dtypes.len()) {
                    continue;
                }
                let s = Shape {
                    n,
                    h,
                    v,
                    bias: false,
                };
                let o = CrossEntropyOptions::default().with_chunk_size(chunk);
                // The larger vocabulary's mean divides by the token count
                // on the device (the label check deferred).
                let o = if i == 1 {
                    o.with_deferred_label_check()
                } else {
                    o
                };
                let x = inputs(&mut rng, s, dtype, -100, 4, false);
                let exp = expected(&x, s, &o, dtype);
                let what = format!("{name} {dtype:?} {s:?}");
                eprintln!("case {what}");
                let got = run_linear::<Bastile<B>>(&x, s, o, dtype, device);
                // `dh` sums V products in f32; the rounding of a sum that
                // long grows with √V (bf16/f16 bounds are set by the output
                // rounding instead).
                let long_sum = if dtype == DType::F32 {
                    (v as f64 / 4096.0).sqrt()
                } else {
                    1.0
                };
                compare(&what, &got, &exp, matmul_tol(dtype, name) * long_sum, seed);
            }
            let s = Shape {
                n: 7,
                h: 16,
                v: 300,
                bias: true,
            };
            for reduction in [Reduction::Mean, Reduction::Sum, Reduction::None] {
                let o = CrossEntropyOptions::default()
                    .with_reduction(reduction)
                    .with_chunk_size(3);
                // A mean over no token, its count on the device: still 0.
                let o = if reduction == Reduction::Mean {
                    o.with_deferred_label_check()
                } else {
                    o
                };
                let mut x = inputs(&mut rng, s, dtype, -100, 0, reduction == Reduction::None);
                x.labels = vec![-100; s.n];
                let got = run_linear::<Bastile<B>>(&x, s, o, dtype, device);
                let what = format!("all ignored {name} {dtype:?} {reduction:?}");
                for (part, v) in [
                    ("loss", &got.loss),
                    ("dh", &got.dh),
                    ("dw", &got.dw),
                    ("db", &got.db),
                ] {
                    assert!(v.iter().all(|x| *x == 0.0), "{part} {what}: {v:?}");
                }
            }
        }
    }
}

backend_test! {
    /// Cross-entropy on given logits, fused and composite, against the
    /// reference: loss, lse and the logits gradient.
    fn cross_entropy_on_logits_matches_reference<B>(device, name, dtypes) {
        let mut rng = Rng::fresh();
        let seed = rng.seed();
        for (d, &dtype) in dtypes.iter().enumerate() {
            for (i, o) in [
                CrossEntropyOptions::default(),
                CrossEntropyOptions::default()
                    .with_reduction(Reduction::None)
                    .with_label_smoothing(0.2),
                CrossEntropyOptions::default()
                    .with_reduction(Reduction::Sum)
                    .with_z_loss(1e-2)
                    .with_softcap(3.0),
            ]
            .into_iter()
            .enumerate()
            {
                if !takes_turn(name, i, d, dtypes.len()) {
                    continue;
                }
                let (n, v) = (13, 257 + i);
                let logits = randn(&mut rng, n * v, 0.0, 3.0, dtype);
                let labels: Vec<i64> = (0..n)
                    .map(|t| {
                        if t % 4 == 2 {
                            -100
                        } else {
                            (rng.next_u64() % v as u64) as i64
                        }
                    })
                    .collect();
                let up: Vec<f64> = if o.reduction == Reduction::None {
                    rng.normals(n, 0.0, 1.0)
                } else {
                    vec![0.5]
                };
                let rows = reference::rows(&logits, v, &labels, &options_of(&o));
                let counted = labels.iter().filter(|&&l| l != -100).count() as f64;
                let scale = if o.reduction == Reduction::Mean {
                    1.0 / counted
                } else {
                    1.0
                };
                let upv = |t: usize| up[if up.len() == 1 { 0 } else { t }];
                let loss_rows: Vec<f64> = rows.iter().map(|r| r.loss).collect();
                let loss_ref = if o.reduction == Reduction::None {
                    loss_rows
                } else {
                    vec![loss_rows.iter().sum::<f64>() * scale]
                };
                let grad_ref: Vec<f64> = rows
                    .iter()
                    .enumerate()
                    .flat_map(|(t, r)| {
                        r.grad
                            .iter()
                            .map(move |g| round_to(kdtype(dtype), g * scale * upv(t)))
                    })
                    .collect();
                let run = |fused: bool| -> (Vec<f64>, Vec<f64>) {
                    fn go<X: BastileBackend>(
                        logits: &[f64],
                        labels: &[i64],
                        up: &[f64],
                        shape: [usize; 2],
                        o: CrossEntropyOptions,
                        dtype: DType,
                        device: &X::Device,
                    ) -> (Vec<f64>, Vec<f64>) {
                        let x =
                            tensor::<Autodiff<X>, 2>(logits, shape, dtype, device).require_grad();
                        let out = cross_entropy(
                            x.clone(),
                            labels_tensor::<Autodiff<X>>(labels, device),
                            o,
                        )
                        .unwrap();
                        let u = tensor::<Autodiff<X>, 1>(up, [up.len()], DType::F32, device);
                        let grads = (out.loss.clone() * u).sum().backward();
                        (values(out.loss.inner()), values(x.grad(&grads).unwrap()))
                    }
                    if fused {
                        go::<Bastile<B>>(&logits, &labels, &up, [n, v], o, dtype, device)
                    } else {
                        go::<B>(&logits, &labels, &up, [n, v], o, dtype, device)
                    }
                };
                for fused in [true, false] {
                    if !fused && !checks_composite(name) {
                        continue;
                    }
                    let (loss, grad) = run(fused);
                    let what = format!("{name} {dtype:?} fused={fused} {o:?}");
                    assert_close(&format!("loss {what}"), &loss, &loss_ref, 2e-5, seed);
                    let tol = bastile_cubecl::testing::tolerance(kdtype(dtype));
                    let what = format!("dlogits {what} seed {seed}");
                    assert_close_to_magnitude(&what, &grad, &grad_ref, tol);
                }
            }
        }
    }
}

backend_test! {
    /// The drop-in loss against `burn::nn::loss::CrossEntropyLoss` (Burn's
    /// semantics: padding rows count 0 in a mean over all rows), and the
    /// linear module against the function.
    fn drop_in_and_module_wrappers_match<B>(device, name, _dtypes) {
        type A<X> = Autodiff<X>;
        let mut rng = Rng::fresh();
        let seed = rng.seed();
        let (n, v) = (11, 40);
        let logits = randn(&mut rng, n * v, 0.0, 2.0, DType::F32);
        let labels: Vec<i64> = (0..n as i64).map(|t| (t * 7) % v as i64).collect();
        for (pads, smoothing) in [(None, None), (Some(vec![0usize, 14]), Some(0.1f32))] {
            let config = CrossEntropyLossConfig::new()
                .with_pad_tokens(pads.clone())
                .with_smoothing(smoothing);
            let ours = {
                let x =
                    tensor::<A<Bastile<B>>, 2>(&logits, [n, v], DType::F32, device).require_grad();
                let loss = config
                    .init::<A<Bastile<B>>>(device)
                    .forward(x.clone(), labels_tensor::<A<Bastile<B>>>(&labels, device));
                let g = loss.backward();
                (values(loss.inner()), values(x.grad(&g).unwrap()))
            };
            let burns = {
                let x = tensor::<A<B>, 2>(&logits, [n, v], DType::F32, device).require_grad();
                let loss = burn::nn::loss::CrossEntropyLossConfig::new()
                    .with_pad_tokens(pads.clone())
                    .with_smoothing(smoothing)
                    .init::<A<B>>(device)
                    .forward(x.clone(), labels_tensor::<A<B>>(&labels, device));
                let g = loss.backward();
                (values(loss.inner()), values(x.grad(&g).unwrap()))
            };
            let what = format!("{name} pads {pads:?} smoothing {smoothing:?}");
            assert_close(
                &format!("drop-in loss {what}"),
                &ours.0,
                &burns.0,
                1e-5,
                seed,
            );
            assert_close(
                &format!("drop-in grad {what}"),
                &ours.1,
                &burns.1,
                1e-4,
                seed,
            );
        }

        // The module on [batch, seq, H] equals the function on flat tokens.
        let (b, s, h, v) = (2, 5, 8, 30);
        let hidden = randn(&mut rng, b * s * h, 0.0, 1.0, DType::F32);
        let weight = randn(&mut rng, v * h, 0.0, 0.5, DType::F32);
        let labels: Vec<i64> = (0..(b * s) as i64).map(|t| (t * 3) % v as i64).collect();
        let loss = LinearCrossEntropyLossConfig::new().with_z_loss(1e-3).init();
        let x3 = tensor::<Bastile<B>, 3>(&hidden, [b, s, h], DType::F32, device);
        let w = tensor::<Bastile<B>, 2>(&weight, [v, h], DType::F32, device);
        let l2: Tensor<Bastile<B>, 2, Int> =
            labels_tensor::<Bastile<B>>(&labels, device).reshape([b, s]);
        let module = loss
            .forward(x3.clone(), w.clone(), None, l2.clone())
            .unwrap();
        let flat = linear_cross_entropy(
            x3.reshape([b * s, h]),
            w,
            None,
            labels_tensor::<Bastile<B>>(&labels, device),
            CrossEntropyOptions::default().with_z_loss(1e-3),
        )
        .unwrap();
        assert_eq!(values(module.loss), values(flat.loss), "{name}");
        let tokens = module.tokens.into_data().convert::<i64>().to_vec::<i64>();
        assert_eq!(tokens.unwrap(), [(b * s) as i64]);
    }
}

#[test]
fn bad_inputs_are_descriptive_errors() {
    type B = Bastile<burn::backend::NdArray>;
    let device = Default::default();
    let h = Tensor::<B, 2>::zeros([4, 8], &device);
    let w = Tensor::<B, 2>::zeros([10, 8], &device);
    let labels = |v: Vec<i64>| {
        Tensor::<B, 1, Int>::from_data(TensorData::new(v.clone(), [v.len()]), &device)
    };
    let run = |h: Tensor<B, 2>, w: Tensor<B, 2>, l: Tensor<B, 1, Int>, o| {
        linear_cross_entropy(h, w, None, l, o).map(|_| ())
    };
    let ok = CrossEntropyOptions::default();
    let err = run(h.clone(), w.clone(), labels(vec![0, 1, 10, 2]), ok).unwrap_err();
    assert!(
        matches!(&err, BastileError::Shape(m) if m.contains("label 10 at position 2")),
        "{err}"
    );
    let err = run(h.clone(), w.clone(), labels(vec![0, -5, 1, 2]), ok).unwrap_err();
    assert!(
        matches!(&err, BastileError::Shape(m) if m.contains("-5")),
        "{err}"
    );
    let err = run(h.clone(), w.clone(), labels(vec![0, 1, 2]), ok).unwrap_err();
    assert!(
        matches!(&err, BastileError::Shape(m) if m.contains("labels have 3")),
        "{err}"
    );
    let err = run(
        h.clone(),
        Tensor::zeros([10, 9], &device),
        labels(vec![0, 1, 2, 3]),
        ok,
    )
    .unwrap_err();
    assert!(
        matches!(&err, BastileError::Shape(m) if m.contains("[10, 9]")),
        "{err}"
    );
    for bad in [
        ok.with_label_smoothing(1.5),
        ok.with_z_loss(-1.0),
        ok.with_softcap(0.0),
        ok.with_normalizer(0.0),
        ok.with_chunk_size(0),
    ] {
        let err = run(h.clone(), w.clone(), labels(vec![0, 1, 2, 3]), bad).unwrap_err();
        assert!(matches!(err, BastileError::Config(_)), "{bad:?}: {err}");
    }
    // The ignore index may be any value, a class id included.
    let out = linear_cross_entropy(
        h.clone(),
        w.clone(),
        None,
        labels(vec![3, 3, 1, 3]),
        ok.with_ignore_index(3),
    )
    .unwrap();
    assert_eq!(out.tokens.into_scalar(), 1);
    // Deferred: nothing is read, the loss skips the bad label, and the
    // check reports it when read.
    let deferred = ok.with_deferred_label_check();
    let out = linear_cross_entropy(
        h.clone(),
        w.clone(),
        None,
        labels(vec![0, 1, 10, 2]),
        deferred,
    )
    .unwrap();
    let check = out.label_check.expect("a deferred check");
    assert!(check.failed().into_scalar());
    let err = check.result().unwrap_err();
    assert!(
        matches!(&err, BastileError::Shape(m) if m.contains("label 10 at position 2")),
        "{err}"
    );
    assert_eq!(out.tokens.into_scalar(), 3);
    let err = cross_entropy(
        Tensor::<B, 2>::zeros([4, 0], &device),
        labels(vec![0, 1, 2, 3]),
        ok,
    )
    .unwrap_err();
    assert!(matches!(err, BastileError::Shape(_)), "{err}");
    let err = linear_cross_entropy(
        h,
        w,
        Some(Tensor::zeros([9], &device)),
        labels(vec![0, 1, 2, 3]),
        ok,
    )
    .unwrap_err();
    assert!(
        matches!(&err, BastileError::Shape(m) if m.contains("bias has 9")),
        "{err}"
    );
}
