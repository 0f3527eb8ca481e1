//! Linear layers through Burn: a linear layer with its LoRA adapter
//! (`lora_linear`), the adapter's update alone (`lora_update`) and the
//! plain layer (`linear`) on `Bastile<B>` (one fused node each) and on `B`
//! (Burn's ops), against the f64 reference: values and the gradients of
//! the input, both adapters and, when the base layer is trained, its
//! weight and bias (a frozen one gets none); with f32 adapters on
//! half-precision activations (the products in the activations' dtype)
//! and odd sizes.

use crate::common::*;
use bastile::{Bastile, BastileBackend, BastileError, lora_linear, lora_update};
use bastile_cubecl::reference::lora as reference;
use bastile_cubecl::testing::{Rng, tolerance};
use burn::backend::Autodiff;
use burn::tensor::{DType, Tensor};

/// What sits under the adapter.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Base {
    /// No base layer: the update alone.
    None,
    /// A frozen weight and bias, as LoRA trains.
    Frozen,
    /// A trained weight and bias.
    Trained,
}

/// The outputs of `Autodiff<X>` in the reference's order (`[y, dx, dA,
/// dB]`, then `dW` and `dbias` for a trained base): `x` `[2, n/2, i]` in `dtype`, the
/// base in `dtype`, the adapters in f32, output gradient `g`.
fn run<X: BastileBackend>(
    p: &reference::Problem,
    base: Base,
    g: &[f64],
    dtype: DType,
    device: &X::Device,
) -> Vec<Vec<f64>> {
    type A<X> = Autodiff<X>;
    let [n, i, r, o] = p.sizes;
    let x = tensor::<A<X>, 3>(p.x, [2, n / 2, i], dtype, device).require_grad();
    let a = tensor::<A<X>, 2>(p.a, [i, r], DType::F32, device).require_grad();
    let b = tensor::<A<X>, 2>(p.b, [r, o], DType::F32, device).require_grad();
    let w = (base != Base::None).then(|| {
        let w = tensor::<A<X>, 2>(p.w, [i, o], dtype, device);
        if base == Base::Trained {
            w.require_grad()
        } else {
            w
        }
    });
    let bias = (!p.bias.is_empty()).then(|| {
        let bias = tensor::<A<X>, 1>(p.bias, [o], dtype, device);
        if base == Base::Trained {
            bias.require_grad()
        } else {
            bias
        }
    });
    let gt = tensor::<A<X>, 3>(g, [2, n / 2, o], dtype, device);
    let out = match &w {
        None => lora_update(x.clone(), a.clone(), b.clone(), p.scale),
        Some(w) => lora_linear(
            x.clone(),
            w.clone(),
            bias.clone(),
            a.clone(),
            b.clone(),
            p.scale,
        ),
    }
    .unwrap();
    assert_eq!(out.dtype(), dtype);
    let grads = (out.clone() * gt).sum().backward();
    let da = a.grad(&grads).expect("dA");
    let db = b.grad(&grads).expect("dB");
    assert_eq!((da.dtype(), db.dtype()), (DType::F32, DType::F32));
    let mut results = vec![
        values(out.inner()),
        values(x.grad(&grads).expect("dx")),
        values(da),
        values(db),
    ];
    match (base, w, bias) {
        (Base::Trained, Some(w), Some(bias)) => {
            results.push(values(w.grad(&grads).expect("dW")));
            results.push(values(bias.grad(&grads).expect("dbias")));
        }
        (_, Some(w), bias) => {
            assert!(
                w.grad(&grads).is_none(),
                "a frozen base weight got a gradient"
            );
            assert!(
                bias.and_then(|b| b.grad(&grads)).is_none(),
                "a frozen bias got a gradient"
            );
        }
        _ => {}
    }
    results
}

/// The reference's outputs in `run`'s order.
fn outputs(p: &reference::Problem, g: &[f64], base: Base) -> Vec<Vec<f64>> {
    let mut out = reference::forward_backward(p, g).to_vec();
    if base == Base::Trained {
        out.extend(reference::base_grads(p, g));
    }
    out
}

backend_test! {
    fn lora_fused_and_composite_match_reference<B>(device, name, dtypes) {
        let mut rng = Rng::fresh();
        let seed = rng.seed();
        for &dtype in dtypes {
            let op = bastile::ops::lora::Lora { scale: 1.0 };
            let query = bastile::fused::DTypeQuery { dtype };
            assert!(bastile::fused::is_fused::<Bastile<B>, _>(&op, device, &query));
            for [n, i, r, o] in [[2usize, 1usize, 1usize, 1usize], [34, 67, 16, 29]] {
                for base in [Base::None, Base::Frozen, Base::Trained] {
                    let x = randn(&mut rng, n * i, 0.0, 1.0, dtype);
                    // f32 adapters whose values the half-precision cast
                    // keeps: the reference then sees what the products see.
                    let a = randn(&mut rng, i * r, 0.0, 0.5, dtype);
                    let b = randn(&mut rng, r * o, 0.0, 0.5, dtype);
                    let g = randn(&mut rng, n * o, 0.0, 1.0, dtype);
                    let (w, bias) = match base {
                        Base::None => (vec![], vec![]),
                        Base::Frozen | Base::Trained => (
                            randn(&mut rng, i * o, 0.0, 0.3, dtype),
                            randn(&mut rng, o, 0.0, 1.0, dtype),
                        ),
                    };
                    // A power of two: the scaled products stay representable.
                    let problem = reference::Problem {
                        sizes: [n, i, r, o],
                        x: &x,
                        w: &w,
                        bias: &bias,
                        a: &a,
                        b: &b,
                        scale: 2.0,
                    };
                    let expected = outputs(&problem, &g, base);
                    // Each element's terms can cancel (a one-token gradient
                    // is a sum of two rounded products): its error scales
                    // with their magnitudes, the outputs of the same problem
                    // in absolute values.
                    let abs = |v: &[f64]| v.iter().map(|e| e.abs()).collect::<Vec<_>>();
                    let (ax, aw, abias, aa, ab, ag) =
                        (abs(&x), abs(&w), abs(&bias), abs(&a), abs(&b), abs(&g));
                    let magnitudes = reference::Problem {
                        x: &ax,
                        w: &aw,
                        bias: &abias,
                        a: &aa,
                        b: &ab,
                        ..problem
                    };
                    let magnitude = outputs(&magnitudes, &ag, base);
                    // Two products in a row round twice in half precision.
                    let tol = 2.0 * tolerance(kdtype(dtype));
                    // Burn's own f32 matmul on CUDA (the composite's) runs at
                    // TF32 precision (~5e-4 per product).
                    let composite_tol = if name.starts_with("cuda") { tol.max(2e-3) } else { tol };
                    let what = format!("{name} {dtype:?} {base:?} [n, i, r, o] = {:?}", [n, i, r, o]);
                    let fused = run::<Bastile<B>>(&problem, base, &g, dtype, device);
                    let composite = checks_composite(name)
                        .then(|| run::<B>(&problem, base, &g, dtype, device));
                    let parts = ["y", "dx", "dA", "dB", "dW", "dbias"];
                    for (k, part) in parts.into_iter().enumerate().take(expected.len()) {
                        let (e, m) = (&expected[k], &magnitude[k]);
                        assert_within(&format!("{part} {what}"), &fused[k], e, m, tol, seed);
                        if let Some(c) = &composite {
                            assert_within(&format!("composite {part} {what}"), &c[k], e, m, composite_tol, seed);
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn lora_rejects_bad_input() {
    type B = Bastile<burn::backend::NdArray>;
    let device = Default::default();
    let x = Tensor::<B, 3>::zeros([2, 3, 8], &device);
    let a = Tensor::<B, 2>::zeros([8, 4], &device);
    let b = Tensor::<B, 2>::zeros([4, 5], &device);
    let w = Tensor::<B, 2>::zeros([8, 5], &device);
    let shape = |r| matches!(r, Err(BastileError::Shape(_)));
    assert!(shape(lora_update(
        x.clone(),
        Tensor::zeros([7, 4], &device),
        b.clone(),
        1.0
    )));
    assert!(shape(lora_update(
        x.clone(),
        a.clone(),
        Tensor::zeros([3, 5], &device),
        1.0
    )));
    assert!(shape(lora_update(
        x.clone(),
        Tensor::zeros([8, 0], &device),
        Tensor::zeros([0, 5], &device),
        1.0
    )));
    assert!(matches!(
        lora_update(x.clone(), a.clone(), b.clone(), f64::NAN),
        Err(BastileError::Config(_))
    ));
    let linear = |w: Tensor<B, 2>, bias: Option<Tensor<B, 1>>| {
        lora_linear(x.clone(), w, bias, a.clone(), b.clone(), 1.0)
    };
    // A weight whose output is not B's, one whose input is not x's, a bias
    // of another length.
    assert!(shape(linear(Tensor::zeros([8, 6], &device), None)));
    assert!(shape(linear(Tensor::zeros([7, 5], &device), None)));
    assert!(shape(linear(w.clone(), Some(Tensor::zeros([4], &device)))));
    assert!(matches!(
        linear(w.clone().cast(DType::F64), None),
        Err(BastileError::DType(_))
    ));
    assert!(matches!(
        lora_linear(
            x.clone(),
            w.clone(),
            None,
            a.clone(),
            b.clone(),
            f64::INFINITY
        ),
        Err(BastileError::Config(_))
    ));
    assert_eq!(
        lora_update(x.clone(), a.clone(), b.clone(), 1.0)
            .unwrap()
            .dims(),
        [2, 3, 5]
    );
    assert_eq!(
        linear(w.clone(), Some(Tensor::zeros([5], &device)))
            .unwrap()
            .dims(),
        [2, 3, 5]
    );
    // The plain layer checks the same.
    let plain = |w: Tensor<B, 2>, bias| bastile::linear(x.clone(), w, bias);
    assert!(shape(plain(Tensor::zeros([7, 5], &device), None)));
    assert!(shape(plain(w.clone(), Some(Tensor::zeros([4], &device)))));
    assert!(matches!(
        plain(w.clone().cast(DType::F64), None),
        Err(BastileError::DType(_))
    ));
    assert_eq!(plain(w, None).unwrap().dims(), [2, 3, 5]);
}

/// `[y, dx, dW, dbias]` of `bastile::linear` on `Autodiff<X>`: `x` `[2,
/// n/2, i]`, the weight and bias in `dtype`, trained or frozen.
fn run_linear<X: BastileBackend>(
    p: &reference::Problem,
    trained: bool,
    g: &[f64],
    dtype: DType,
    device: &X::Device,
) -> Vec<Vec<f64>> {
    type A<X> = Autodiff<X>;
    let [n, i, _, o] = p.sizes;
    let x = tensor::<A<X>, 3>(p.x, [2, n / 2, i], dtype, device).require_grad();
    let (mut w, mut bias) = (
        tensor::<A<X>, 2>(p.w, [i, o], dtype, device),
        tensor::<A<X>, 1>(p.bias, [o], dtype, device),
    );
    if trained {
        (w, bias) = (w.require_grad(), bias.require_grad());
    }
    let out = bastile::linear(x.clone(), w.clone(), Some(bias.clone())).unwrap();
    assert_eq!(out.dtype(), dtype);
    let grads = (out.clone() * tensor::<A<X>, 3>(g, [2, n / 2, o], dtype, device))
        .sum()
        .backward();
    let mut results = vec![values(out.inner()), values(x.grad(&grads).expect("dx"))];
    if trained {
        results.push(values(w.grad(&grads).expect("dW")));
        results.push(values(bias.grad(&grads).expect("dbias")));
    } else {
        assert!(w.grad(&grads).is_none() && bias.grad(&grads).is_none());
    }
    results
}

backend_test! {
    fn linear_fused_and_composite_match_reference<B>(device, name, dtypes) {
        let mut rng = Rng::fresh();
        let seed = rng.seed();
        for &dtype in dtypes {
            let query = bastile::fused::DTypeQuery { dtype };
            assert!(bastile::fused::is_fused::<Bastile<B>, _>(&bastile::ops::linear::Linear, device, &query));
            for [n, i, o] in [[2usize, 1usize, 1usize], [34, 67, 29]] {
                for trained in [false, true] {
                    let x = randn(&mut rng, n * i, 0.0, 1.0, dtype);
                    let w = randn(&mut rng, i * o, 0.0, 0.3, dtype);
                    let bias = randn(&mut rng, o, 0.0, 1.0, dtype);
                    let g = randn(&mut rng, n * o, 0.0, 1.0, dtype);
                    // No adapter: the reference's update is zero.
                    let zeros = vec![0.0; i.max(o)];
                    let problem = reference::Problem {
                        sizes: [n, i, 1, o],
                        x: &x,
                        w: &w,
                        bias: &bias,
                        a: &zeros[..i],
                        b: &zeros[..o],
                        scale: 0.0,
                    };
                    let abs = |v: &[f64]| v.iter().map(|e| e.abs()).collect::<Vec<_>>();
                    let (ax, aw, abias, ag) = (abs(&x), abs(&w), abs(&bias), abs(&g));
                    let magnitudes = reference::Problem { x: &ax, w: &aw, bias: &abias, ..problem };
                    let expect = |p: &reference::Problem, g: &[f64]| {
                        let [y, dx, _, _] = reference::forward_backward(p, g);
                        let mut out = vec![y, dx];
                        if trained {
                            out.extend(reference::base_grads(p, g));
                        }
                        out
                    };
                    let (expected, magnitude) = (expect(&problem, &g), expect(&magnitudes, &ag));
                    let tol = tolerance(kdtype(dtype));
                    let composite_tol = if name.starts_with("cuda") { tol.max(2e-3) } else { tol };
                    let what = format!("{name} {dtype:?} trained {trained} [n, i, o] = {:?}", [n, i, o]);
                    let fused = run_linear::<Bastile<B>>(&problem, trained, &g, dtype, device);
                    let composite = checks_composite(name)
                        .then(|| run_linear::<B>(&problem, trained, &g, dtype, device));
                    for (k, part) in ["y", "dx", "dW", "dbias"].into_iter().enumerate().take(expected.len()) {
                        let (e, m) = (&expected[k], &magnitude[k]);
                        assert_within(&format!("{part} {what}"), &fused[k], e, m, tol, seed);
                        if let Some(c) = &composite {
                            assert_within(&format!("composite {part} {what}"), &c[k], e, m, composite_tol, seed);
                        }
                    }
                }
            }
        }
    }
}
