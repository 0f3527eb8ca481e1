//! Sums, means and maxima along one dimension on `Bastile<B>` (its
//! fixed-strategy reduction kernels) against the f64 reference, over the
//! three launch routines (a unit, a plane or a cube per output), reduced
//! dimensions that are contiguous, outermost and in the middle, and odd
//! sizes; and a linear layer's bias gradient, one such sum over every
//! row.

use crate::common::*;
use bastile::Bastile;
use bastile::ops::reduce::{ReduceDim, Reduction};
use bastile_cubecl::testing::{Rng, assert_close, tolerance};
use burn::tensor::Tensor;

/// `x` (row-major, `shape`) reduced over `dim` in f64.
fn reference(x: &[f64], shape: [usize; 3], dim: usize, reduction: Reduction) -> Vec<f64> {
    let length = shape[dim];
    let inner: usize = shape[dim + 1..].iter().product();
    let outer: usize = shape[..dim].iter().product();
    let mut out = Vec::with_capacity(outer * inner);
    for o in 0..outer {
        for i in 0..inner {
            let at = |k: usize| x[(o * length + k) * inner + i];
            out.push(match reduction {
                Reduction::Sum => (0..length).map(at).sum(),
                Reduction::Mean => (0..length).map(at).sum::<f64>() / length as f64,
                Reduction::Max => (0..length).map(at).fold(f64::NEG_INFINITY, f64::max),
            });
        }
    }
    out
}

backend_test! {
    fn reductions_along_a_dimension_match_the_reference<B>(device, name, dtypes) {
        let mut rng = Rng::fresh();
        let seed = rng.seed();
        // (shape, dim): one unit per output (a short row), a cube per
        // output (few outputs, long rows; the outermost dimension), a
        // plane per output (many long rows; contiguous and outermost), and
        // a middle dimension.
        let cases = [
            ([1usize, 3, 37], 2usize),
            ([1, 300, 5], 1),
            ([1, 700, 130], 2),
            ([1, 130, 700], 1),
            ([4, 129, 3], 1),
            ([2, 70, 5], 0),
        ];
        for &dtype in dtypes {
            for (shape, dim) in cases {
                let x = randn(&mut rng, shape.iter().product(), 0.5, 1.0, dtype);
                let t = tensor::<Bastile<B>, 3>(&x, shape, dtype, device);
                let query = bastile::fused::DTypeQuery { dtype };
                let op = ReduceDim { reduction: Reduction::Sum, dim };
                assert!(bastile::fused::is_fused::<Bastile<B>, _>(&op, device, &query));
                for reduction in [Reduction::Sum, Reduction::Mean, Reduction::Max] {
                    let out: Tensor<Bastile<B>, 3> = match reduction {
                        Reduction::Sum => t.clone().sum_dim(dim),
                        Reduction::Mean => t.clone().mean_dim(dim),
                        Reduction::Max => t.clone().max_dim(dim),
                    };
                    let mut dims = shape;
                    dims[dim] = 1;
                    assert_eq!(out.dims(), dims);
                    assert_eq!(out.dtype(), dtype);
                    let expected = reference(&x, shape, dim, reduction);
                    let what = format!("{name} {dtype:?} {reduction:?} of {shape:?} over {dim}");
                    if reduction == Reduction::Max {
                        // A maximum is one of the values: exact.
                        assert_eq!(values(out), expected, "{what}");
                    } else {
                        // Accumulated in f32 and rounded once to the
                        // dtype (the values' mean of 0.5 keeps the sums
                        // away from 0, so that rounding is relative).
                        let tol = 2.0 * tolerance(kdtype(dtype));
                        assert_close(&what, &values(out), &expected, tol, seed);
                    }
                }
            }
        }
    }
}

backend_test! {
    fn a_linear_layers_bias_gradient_sums_every_row<B>(device, name, dtypes) {
        use burn::backend::Autodiff;
        type A<X> = Autodiff<Bastile<X>>;
        let mut rng = Rng::fresh();
        let seed = rng.seed();
        // [batch, seq, in] → [batch, seq, out]: the gradient of the bias
        // sums the upstream gradient over batch and sequence; `out` long
        // enough for the plane routine (rows > 64, outputs > 256).
        let ([b, s, i], o) = ([3usize, 41, 5], 300usize);
        for &dtype in dtypes {
            let x = randn(&mut rng, b * s * i, 0.0, 1.0, dtype);
            let w = randn(&mut rng, i * o, 0.0, 1.0, dtype);
            let bias = randn(&mut rng, o, 0.0, 1.0, dtype);
            let dy = randn(&mut rng, b * s * o, 0.5, 1.0, dtype);
            let xt = tensor::<A<B>, 3>(&x, [b, s, i], dtype, device);
            let wt = tensor::<A<B>, 2>(&w, [i, o], dtype, device);
            let bt = tensor::<A<B>, 1>(&bias, [o], dtype, device).require_grad();
            let y = burn::tensor::module::linear(xt, wt, Some(bt.clone()));
            let dyt = tensor::<A<B>, 3>(&dy, [b, s, o], dtype, device);
            let grads = (y * dyt).sum().backward();
            let got = values(bt.grad(&grads).expect("the bias gradient"));
            let expected: Vec<f64> = (0..o)
                .map(|j| (0..b * s).map(|r| dy[r * o + j]).sum())
                .collect();
            let what = format!("{name} {dtype:?} bias gradient of [{b}, {s}, {i}] → {o}");
            assert_close(&what, &got, &expected, 2.0 * tolerance(kdtype(dtype)), seed);
        }
    }
}
