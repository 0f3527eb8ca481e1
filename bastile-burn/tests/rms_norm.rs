//! RMSNorm through Burn: `Bastile<B>` (fused) against `B` (composite) and the
//! f64 reference, forward and gradients under `Autodiff`, on the direct and
//! the fusion flavour of each runtime.

use crate::common::*;
use bastile::ops::rms_norm::rms_norm;
use bastile::{Bastile, BastileBackend, BastileError, RmsNormCast};
use bastile_cubecl::reference::rms_norm as reference;
use bastile_cubecl::testing::{Rng, assert_close, round_to, tolerance};
use burn::backend::Autodiff;
use burn::tensor::{DType, Tensor};

/// Forward and gradients of `Autodiff<X>` for one input, as f64:
/// `(y, dx, dgamma)` with `dy` as the output gradient.
fn run_autodiff<X: BastileBackend>(
    x: &[f64],
    gamma: &[f64],
    dy: &[f64],
    shape: [usize; 3],
    dtype: DType,
    cast: RmsNormCast,
    device: &X::Device,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    type A<X> = Autodiff<X>;
    let hidden = shape[2];
    let xt = tensor::<A<X>, 3>(x, shape, dtype, device).require_grad();
    let gt = tensor::<A<X>, 1>(gamma, [hidden], dtype, device).require_grad();
    let dyt = tensor::<A<X>, 3>(dy, shape, dtype, device);
    let y = rms_norm(xt.clone(), gt.clone(), 1e-6, cast).unwrap();
    // d(sum(y ⊙ dy))/dy = dy: the backward receives exactly `dy`.
    let grads = (y.clone() * dyt).sum().backward();
    let dx = xt.grad(&grads).expect("x gradient");
    let dg = gt.grad(&grads).expect("gamma gradient");
    (values(y.inner()), values(dx), values(dg))
}

backend_test! {
    fn rms_norm_autodiff_fused_matches_composite_and_reference<B>(device, name, dtypes) {
        let mut rng = Rng::fresh();
        let seed = rng.seed();
        for &dtype in dtypes {
            for (shape, cast) in [
                ([1, 1, 64], RmsNormCast::Llama),
                ([2, 3, 896], RmsNormCast::GptOss),
                ([3, 37, 1000], RmsNormCast::Llama),
                ([1, 4097, 128], RmsNormCast::GptOss),
            ] {
                let [b, s, h] = shape;
                assert!(
                    bastile::fused::is_fused::<Bastile<B>, _>(
                        &bastile::ops::rms_norm::RmsNorm { eps: 1e-6, cast },
                        device,
                        &bastile::ops::rms_norm::RmsNormQuery { hidden: h, dtype }
                    ),
                    "{name}: the fused path should take hidden {h} {dtype:?}"
                );
                let n = b * s * h;
                let x = randn(&mut rng, n, 0.2, 1.3, dtype);
                let gamma = randn(&mut rng, h, 1.0, 0.4, dtype);
                let dy = randn(&mut rng, n, 0.0, 1.0, dtype);
                let round = |v| round_to(kdtype(dtype), v);
                let (y_ref, _) = reference::forward(&x, &gamma, h, 1e-6, cast, round);
                let (dx_ref, dg_ref) = reference::backward(&x, &gamma, &dy, h, 1e-6, cast, round);

                let fused = run_autodiff::<Bastile<B>>(&x, &gamma, &dy, shape, dtype, cast, device);
                let tol = tolerance(kdtype(dtype));
                let dg_tol = tol.max(1e-6 * ((b * s) as f64).sqrt());
                let what = format!("{name} {dtype:?} {shape:?} {cast:?}");
                assert_close(&format!("fused y {what}"), &fused.0, &y_ref, tol, seed);
                assert_close(&format!("fused dx {what}"), &fused.1, &dx_ref, tol, seed);
                assert_close(
                    &format!("fused dgamma {what}"),
                    &fused.2,
                    &dg_ref,
                    dg_tol,
                    seed,
                );
                // The composite path is the reference semantics too.
                if !checks_composite(name) {
                    continue;
                }
                let composite = run_autodiff::<B>(&x, &gamma, &dy, shape, dtype, cast, device);
                assert_close(
                    &format!("composite y {what}"),
                    &composite.0,
                    &y_ref,
                    tol,
                    seed,
                );
                assert_close(
                    &format!("fused vs composite dx {what}"),
                    &fused.1,
                    &composite.1,
                    2.0 * tol,
                    seed,
                );
                assert_close(
                    &format!("fused vs composite dgamma {what}"),
                    &fused.2,
                    &composite.2,
                    2.0 * dg_tol,
                    seed,
                );
            }
        }
    }
}

backend_test! {
    fn rms_norm_non_contiguous_input<B>(device, name, _dtypes) {
        let mut rng = Rng::fresh();
        let seed = rng.seed();
        let (rows, hidden) = (33, 200);
        // A transposed view: rows are strided, not contiguous.
        let xt_vals = randn(&mut rng, rows * hidden, 0.0, 1.0, DType::F32);
        let gamma = randn(&mut rng, hidden, 1.0, 0.3, DType::F32);
        let x_view =
            tensor::<Bastile<B>, 2>(&xt_vals, [hidden, rows], DType::F32, device).transpose();
        let x_rows: Vec<f64> = (0..rows)
            .flat_map(|r| (0..hidden).map(move |h| (r, h)))
            .map(|(r, h)| xt_vals[h * rows + r])
            .collect();
        let g = tensor::<Bastile<B>, 1>(&gamma, [hidden], DType::F32, device);
        let y = rms_norm(x_view, g, 1e-5, RmsNormCast::Llama).unwrap();
        let (y_ref, _) =
            reference::forward(&x_rows, &gamma, hidden, 1e-5, RmsNormCast::Llama, |v| {
                v as f32 as f64
            });
        assert_close(
            &format!("{name} transposed input"),
            &values(y),
            &y_ref,
            1e-5,
            seed,
        );
    }
}

backend_test! {
    fn rms_norm_rejects_bad_input_with_descriptive_errors<B>(device, name, dtypes) {
        type T<B> = Bastile<B>;
        let x = Tensor::<T<B>, 2>::ones([4, 8], device);
        let wrong = Tensor::<T<B>, 1>::ones([7], device);
        let err = rms_norm(x.clone(), wrong, 1e-6, RmsNormCast::Llama).unwrap_err();
        assert!(
            matches!(&err, BastileError::Shape(m) if m.contains("7") && m.contains("8")),
            "{name}: {err}"
        );
        let gamma = Tensor::<T<B>, 1>::ones([8], device);
        let err = rms_norm(x.clone(), gamma.clone(), 0.0, RmsNormCast::Llama).unwrap_err();
        assert!(matches!(err, BastileError::Config(_)), "{name}: {err}");
        if dtypes.contains(&DType::F16) {
            let err = rms_norm(
                x.clone(),
                gamma.clone().cast(DType::F16),
                1e-6,
                RmsNormCast::Llama,
            )
            .unwrap_err();
            assert!(matches!(err, BastileError::DType(_)), "{name}: {err}");
        }
        let ints = Tensor::<T<B>, 2, burn::tensor::Int>::ones([4, 8], device)
            .float()
            .cast(DType::F32);
        assert!(rms_norm(ints, gamma, 1e-6, RmsNormCast::Llama).is_ok());
    }
}
