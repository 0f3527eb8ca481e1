//! The LoRA update through Burn: `Bastile<B>` (one fused node) against `B`
//! (Burn's ops) and the f64 reference, values and the gradients of the
//! input and both adapters, with f32 adapters on half-precision
//! activations (the products in the activations' dtype) and odd sizes.

use crate::common::*;
use bastile::{Bastile, BastileBackend, BastileError, lora_update};
use bastile_cubecl::reference::lora as reference;
use bastile_cubecl::testing::{Rng, assert_close, tolerance};
use burn::backend::Autodiff;
use burn::tensor::{DType, Tensor};

/// `[update, dx, dA, dB]` of `Autodiff<X>`: `x` `[2, n/2, i]` in `dtype`,
/// the adapters in f32, output gradient `g`.
fn run<X: BastileBackend>(
    p: &reference::Problem,
    g: &[f64],
    dtype: DType,
    device: &X::Device,
) -> [Vec<f64>; 4] {
    let [n, i, r, o] = p.sizes;
    let x = tensor::<Autodiff<X>, 3>(p.x, [2, n / 2, i], dtype, device).require_grad();
    let a = tensor::<Autodiff<X>, 2>(p.a, [i, r], DType::F32, device).require_grad();
    let b = tensor::<Autodiff<X>, 2>(p.b, [r, o], DType::F32, device).require_grad();
    let gt = tensor::<Autodiff<X>, 3>(g, [2, n / 2, o], dtype, device);
    let out = lora_update(x.clone(), a.clone(), b.clone(), p.scale).unwrap();
    assert_eq!(out.dtype(), dtype);
    let grads = (out.clone() * gt).sum().backward();
    let da = a.grad(&grads).expect("dA");
    let db = b.grad(&grads).expect("dB");
    assert_eq!((da.dtype(), db.dtype()), (DType::F32, DType::F32));
    [
        values(out.inner()),
        values(x.grad(&grads).expect("dx")),
        values(da),
        values(db),
    ]
}

backend_test! {
    fn lora_update_fused_and_composite_match_reference<B>(device, name, dtypes) {
        let mut rng = Rng::fresh();
        let seed = rng.seed();
        for &dtype in dtypes {
            let op = bastile::ops::lora::LoraUpdate { scale: 1.0 };
            let query = bastile::fused::DTypeQuery { dtype };
            assert!(bastile::fused::is_fused::<Bastile<B>, _>(&op, device, &query));
            for [n, i, r, o] in [[2usize, 1usize, 1usize, 1usize], [34, 67, 16, 29]] {
                let x = randn(&mut rng, n * i, 0.0, 1.0, dtype);
                // f32 adapters whose values the half-precision cast keeps:
                // the reference then sees what the products see.
                let a = randn(&mut rng, i * r, 0.0, 0.5, dtype);
                let b = randn(&mut rng, r * o, 0.0, 0.5, dtype);
                let g = randn(&mut rng, n * o, 0.0, 1.0, dtype);
                // A power of two: the scaled B stays representable.
                let problem = reference::Problem {
                    sizes: [n, i, r, o],
                    x: &x,
                    w: &[],
                    bias: &[],
                    a: &a,
                    b: &b,
                    scale: 2.0,
                };
                let expected = reference::forward_backward(&problem, &g);
                // Two products in a row round twice in half precision.
                let tol = 2.0 * tolerance(kdtype(dtype));
                let what = format!("{name} {dtype:?} [n, i, r, o] = {:?}", [n, i, r, o]);
                let fused = run::<Bastile<B>>(&problem, &g, dtype, device);
                let composite = checks_composite(name).then(|| run::<B>(&problem, &g, dtype, device));
                for (k, part) in ["update", "dx", "dA", "dB"].into_iter().enumerate() {
                    assert_close(&format!("{part} {what}"), &fused[k], &expected[k], tol, seed);
                    if let Some(c) = &composite {
                        assert_close(&format!("composite {part} {what}"), &c[k], &expected[k], tol, seed);
                    }
                }
            }
        }
    }
}

#[test]
fn lora_update_rejects_bad_input() {
    type B = Bastile<burn::backend::NdArray>;
    let device = Default::default();
    let x = Tensor::<B, 3>::zeros([2, 3, 8], &device);
    let a = Tensor::<B, 2>::zeros([8, 4], &device);
    let b = Tensor::<B, 2>::zeros([4, 5], &device);
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
    let out = lora_update(x, a, b, 1.0).unwrap();
    assert_eq!(out.dims(), [2, 3, 5]);
}
