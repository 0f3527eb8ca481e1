//! GPT-OSS GEGLU through Burn: `Bastile<B>` (fused) against `B` (composite)
//! and the f64 reference, forward and gradients under `Autodiff`, including
//! inputs on and beyond the clamp limits.

use crate::common::*;
use bastile::ops::geglu::{GEGLU_OSS_ALPHA, GEGLU_OSS_LIMIT};
use bastile::{Bastile, BastileBackend, BastileError, geglu_oss};
use bastile_cubecl::reference::geglu as reference;
use bastile_cubecl::testing::{Rng, assert_close, round_to, tolerance};
use burn::backend::Autodiff;
use burn::tensor::{DType, Tensor};

/// `(out, d_input)` of `Autodiff<X>` with `dout` as output gradient.
fn run<X: BastileBackend>(
    x: &[f64],
    dout: &[f64],
    shape: [usize; 2],
    dtype: DType,
    device: &X::Device,
) -> (Vec<f64>, Vec<f64>) {
    let [rows, width] = shape;
    let xt = tensor::<Autodiff<X>, 2>(x, shape, dtype, device).require_grad();
    let d = tensor::<Autodiff<X>, 2>(dout, [rows, width / 2], dtype, device);
    let out = geglu_oss(xt.clone(), GEGLU_OSS_ALPHA, GEGLU_OSS_LIMIT).unwrap();
    let grads = (out.clone() * d).sum().backward();
    (values(out.inner()), values(xt.grad(&grads).expect("grad")))
}

backend_test! {
    fn geglu_fused_and_composite_match_reference_under_autodiff<B>(device, name, dtypes) {
        let mut rng = Rng::fresh();
        let seed = rng.seed();
        let limit = GEGLU_OSS_LIMIT;
        for &dtype in dtypes {
            let op = bastile::ops::geglu::GegluOss {
                alpha: bastile::ops::geglu::GEGLU_OSS_ALPHA,
                limit,
            };
            let query = bastile::fused::DTypeQuery { dtype };
            assert!(bastile::fused::is_fused::<Bastile<B>, _>(
                &op, device, &query
            ));
            for (rows, inter) in [(1usize, 1usize), (3, 37), (17, 2880)] {
                let mut x = randn(&mut rng, rows * 2 * inter, 0.0, 5.0, dtype);
                // The clamp boundaries and far beyond, on gate and up slots.
                for (i, v) in [limit, -limit, limit + 1.0, 1e4, -1e4, limit, -limit - 1.0]
                    .into_iter()
                    .enumerate()
                {
                    if i + 1 < x.len() {
                        x[i + 1] = v;
                    }
                }
                x[0] = limit;
                let dout = randn(&mut rng, rows * inter, 0.0, 1.0, dtype);
                let round = |v| round_to(kdtype(dtype), v);
                let out_ref = reference::forward(&x, GEGLU_OSS_ALPHA, limit, round);
                let dx_ref = reference::backward(&x, &dout, GEGLU_OSS_ALPHA, limit, round);
                let shape = [rows, 2 * inter];
                let fused = run::<Bastile<B>>(&x, &dout, shape, dtype, device);
                let tol = tolerance(kdtype(dtype));
                let what = format!("{name} {dtype:?} {shape:?}");
                assert_close(&format!("out {what}"), &fused.0, &out_ref, tol, seed);
                assert_close(&format!("dx {what}"), &fused.1, &dx_ref, tol, seed);
                let composite =
                    checks_composite(name).then(|| run::<B>(&x, &dout, shape, dtype, device));
                if let Some(composite) = &composite {
                    assert_close(
                        &format!("composite out {what}"),
                        &composite.0,
                        &out_ref,
                        tol,
                        seed,
                    );
                    assert_close(
                        &format!("composite dx {what}"),
                        &composite.1,
                        &dx_ref,
                        tol,
                        seed,
                    );
                }
                // Exact zeros where a clamp is active, in both paths.
                for (i, &v) in x.iter().enumerate() {
                    let active = if i % 2 == 0 {
                        v > limit
                    } else {
                        v.abs() > limit
                    };
                    if active {
                        assert_eq!(fused.1[i], 0.0, "{what}: fused gradient at {i} (x {v})");
                        if let Some(composite) = &composite {
                            assert_eq!(composite.1[i], 0.0, "{what}: composite gradient at {i}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn geglu_rejects_bad_input() {
    type B = Bastile<burn::backend::NdArray>;
    let device = Default::default();
    let odd = Tensor::<B, 2>::zeros([2, 5], &device);
    assert!(matches!(
        geglu_oss(odd, 1.702, 7.0),
        Err(BastileError::Shape(_))
    ));
    let even = Tensor::<B, 2>::zeros([2, 4], &device);
    assert!(matches!(
        geglu_oss(even.clone(), 1.702, -1.0),
        Err(BastileError::Config(_))
    ));
    assert!(matches!(
        geglu_oss(even, f64::NAN, 7.0),
        Err(BastileError::Config(_))
    ));
}
