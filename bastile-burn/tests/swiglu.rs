//! SwiGLU through Burn: `Bastile<B>` (fused) against `B` (composite) and the
//! f64 reference, forward and gradients under `Autodiff`, separate and
//! packed inputs, non-contiguous views, inputs the caller holds left intact
//! (the backward writes its gradients over activations only the graph
//! holds), the drop-in modules.

use crate::common::*;
use bastile::nn::{SwiGluConfig, SwiGluMlpConfig};
use bastile::{Bastile, BastileBackend, BastileError, swiglu, swiglu_packed};
use bastile_cubecl::reference::swiglu as reference;
use bastile_cubecl::testing::{Rng, assert_close, assert_close_to_size, round_to, tolerance};
use burn::backend::Autodiff;
use burn::module::Module;
use burn::tensor::{DType, Distribution, Tensor};

/// `(out, d_gate, d_up)` of `Autodiff<X>` with `dout` as output gradient.
#[allow(clippy::too_many_arguments)]
fn run<X: BastileBackend>(
    gate: &[f64],
    up: &[f64],
    dout: &[f64],
    shape: [usize; 3],
    dtype: DType,
    packed: bool,
    transposed: bool,
    device: &X::Device,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    type A<X> = Autodiff<X>;
    let [b, s, i] = shape;
    let g = tensor::<A<X>, 3>(gate, shape, dtype, device).require_grad();
    let u = tensor::<A<X>, 3>(up, shape, dtype, device).require_grad();
    let d = tensor::<A<X>, 3>(dout, shape, dtype, device);
    let out = if packed {
        swiglu_packed(Tensor::cat(vec![g.clone(), u.clone()], 2)).unwrap()
    } else if transposed {
        // Non-contiguous operands: swap the two outer dims and back.
        let gt = g.clone().swap_dims(0, 1);
        let ut = u.clone().swap_dims(0, 1);
        swiglu(gt, ut).unwrap().swap_dims(0, 1)
    } else {
        swiglu(g.clone(), u.clone()).unwrap()
    };
    assert_eq!(out.dims(), [b, s, i]);
    let held = [values(g.clone().inner()), values(u.clone().inner())];
    let grads = (out.clone() * d).sum().backward();
    // The backward writes its gradients over activations only the graph
    // held (the packed concatenation), never over tensors the caller holds.
    assert_eq!(
        [values(g.clone().inner()), values(u.clone().inner())],
        held,
        "the backward changed the inputs (packed={packed} transposed={transposed})"
    );
    (
        values(out.inner()),
        values(g.grad(&grads).expect("gate grad")),
        values(u.grad(&grads).expect("up grad")),
    )
}

backend_test! {
    fn swiglu_fused_and_composite_match_reference_under_autodiff<B>(device, name, dtypes) {
        let mut rng = Rng::fresh();
        let seed = rng.seed();
        for &dtype in dtypes {
            assert!(
                bastile::fused::is_fused::<Bastile<B>, _>(
                    &bastile::ops::swiglu::SwiGlu,
                    device,
                    &bastile::fused::DTypeQuery { dtype }
                ),
                "{name}: SwiGLU should be fused for {dtype:?}"
            );
            for (shape, packed, transposed) in [
                ([1, 1, 1], false, false),
                ([2, 3, 37], true, false),
                ([3, 5, 1000], false, true),
                ([1, 7, 2880], true, false),
                ([2, 4, 256], false, false),
            ] {
                let n = shape.iter().product();
                let gate = randn(&mut rng, n, 0.0, 3.0, dtype);
                let up = randn(&mut rng, n, 0.0, 1.0, dtype);
                let dout = randn(&mut rng, n, 0.0, 1.0, dtype);
                let round = |v| round_to(kdtype(dtype), v);
                let out_ref = reference::forward(&gate, &up, round);
                let (dg_ref, du_ref) = reference::backward(&gate, &up, &dout, round);
                let args = (&gate, &up, &dout, shape, dtype, packed, transposed);
                let fused = run::<Bastile<B>>(
                    args.0, args.1, args.2, args.3, args.4, args.5, args.6, device,
                );
                let tol = tolerance(kdtype(dtype));
                let what =
                    format!("{name} {dtype:?} {shape:?} packed={packed} transposed={transposed}");
                let mut paths = vec![("", fused)];
                if checks_composite(name) {
                    let composite = run::<B>(
                        args.0, args.1, args.2, args.3, args.4, args.5, args.6, device,
                    );
                    paths.push(("composite ", composite));
                }
                let dg_size = reference::d_gate_size(&gate, &up, &dout, &dg_ref);
                for (path, got) in &paths {
                    assert_close(&format!("{path}out {what}"), &got.0, &out_ref, tol, seed);
                    assert_close(&format!("{path}d_up {what}"), &got.2, &du_ref, tol, seed);
                    let label = format!("{path}d_gate (error over its terms' size) {what}");
                    assert_close_to_size(&label, &got.1, &dg_ref, &dg_size, tol, seed);
                }
            }
        }
    }
}

backend_test! {
    /// The drop-in modules: `SwiGlu` loads `burn::nn::SwiGlu`'s record and
    /// gives its output; `SwiGluMlp` is `down(silu(gate(x)) · up(x))`.
    fn swiglu_modules_match_burn<B>(device, name, _dtypes) {
        type F<B> = Bastile<B>;
        let burn_module = burn::nn::SwiGluConfig::new(24, 40)
            .with_bias(true)
            .init::<F<B>>(device);
        let x = Tensor::<F<B>, 3>::random([2, 3, 24], Distribution::Normal(0.0, 1.0), device);
        // Burn draws parameters lazily: run the module once so its record
        // holds the values it computes with.
        let expected = values(burn_module.forward(x.clone()));
        let ours = SwiGluConfig::new(24, 40)
            .with_bias(true)
            .init::<F<B>>(device)
            .load_record(bastile::nn::SwiGluRecord {
                linear_inner: burn_module.linear_inner.clone().into_record(),
                linear_outer: burn_module.linear_outer.clone().into_record(),
            });
        assert_close(
            &format!("{name} SwiGlu drop-in"),
            &values(ours.forward(x.clone())),
            &expected,
            1e-5,
            0,
        );

        let mlp = SwiGluMlpConfig::new(24, 40).init::<F<B>>(device);
        let g = mlp.gate_proj.forward(x.clone());
        let u = mlp.up_proj.forward(x.clone());
        let expected = mlp.down_proj.forward(burn::tensor::activation::silu(g) * u);
        assert_close(
            &format!("{name} SwiGluMlp"),
            &values(mlp.forward(x)),
            &values(expected),
            1e-5,
            0,
        );
    }
}

#[test]
fn swiglu_rejects_mismatched_inputs() {
    type B = Bastile<burn::backend::NdArray>;
    let device = Default::default();
    let a = Tensor::<B, 2>::zeros([2, 4], &device);
    let b = Tensor::<B, 2>::zeros([2, 5], &device);
    assert!(matches!(swiglu(a.clone(), b), Err(BastileError::Shape(_))));
    assert!(matches!(
        swiglu_packed(Tensor::<B, 2>::zeros([2, 5], &device)),
        Err(BastileError::Shape(_))
    ));
    let c = Tensor::<B, 2>::zeros([2, 4], (&device, DType::F64));
    assert!(matches!(swiglu(a, c), Err(BastileError::DType(_))));
}
