//! Sums, means, maxima and minima along one dimension on `Bastile<B>` (its
//! fixed-strategy reduction kernels) against the f64 reference, over the
//! three launch routines (a unit, a plane or a cube per output), reduced
//! dimensions that are contiguous, outermost and in the middle, and odd
//! sizes; a linear layer's bias gradient, one such sum over every row;
//! whole-tensor sums, means, maxima and minima in one launch, in two and
//! through the backend's own op; and sums, maxima and minima of ints,
//! which must be exact.

use crate::common::*;
use bastile::Bastile;
use bastile::ops::reduce::{
    IntReduceDim, ONE_LAUNCH_MAX, ReduceDim, Reduction, StorageQuery, WHOLE_ROW, whole_tensor_rows,
};
use bastile_cubecl::testing::{Rng, assert_close, tolerance};
use burn::tensor::{DType, Int, Tensor, TensorData};

const REDUCTIONS: [Reduction; 4] = [
    Reduction::Sum,
    Reduction::Mean,
    Reduction::Max,
    Reduction::Min,
];

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
                Reduction::Min => (0..length).map(at).fold(f64::INFINITY, f64::min),
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
                for reduction in REDUCTIONS {
                    let out: Tensor<Bastile<B>, 3> = match reduction {
                        Reduction::Sum => t.clone().sum_dim(dim),
                        Reduction::Mean => t.clone().mean_dim(dim),
                        Reduction::Max => t.clone().max_dim(dim),
                        Reduction::Min => t.clone().min_dim(dim),
                    };
                    let mut dims = shape;
                    dims[dim] = 1;
                    assert_eq!(out.dims(), dims);
                    assert_eq!(out.dtype(), dtype);
                    let expected = reference(&x, shape, dim, reduction);
                    let what = format!("{name} {dtype:?} {reduction:?} of {shape:?} over {dim}");
                    if matches!(reduction, Reduction::Max | Reduction::Min) {
                        // A maximum or minimum is one of the values: exact.
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

backend_test! {
    fn whole_tensor_reductions_match_the_reference<B>(device, name, dtypes) {
        let mut rng = Rng::fresh();
        let seed = rng.seed();
        // One element, odd sizes and the largest tensor in one launch,
        // two launches (rows, then their results) and a size neither
        // takes (the backend's own op; a multiple of 4, which it reads in
        // vectors of 4: the software Vulkan driver ends a shader's loop
        // after 65535 iterations).
        let cases = [
            [1usize, 1],
            [3, 37],
            [29, 141],
            [ONE_LAUNCH_MAX / 64, 64],
            [67, WHOLE_ROW],
            [1, ONE_LAUNCH_MAX + 4],
        ];
        assert_eq!(whole_tensor_rows(ONE_LAUNCH_MAX), Some(1));
        assert_eq!(whole_tensor_rows(67 * WHOLE_ROW), Some(67));
        assert_eq!(whole_tensor_rows(ONE_LAUNCH_MAX + 4), None);
        for &dtype in dtypes {
            for shape in cases {
                let n = shape[0] * shape[1];
                let x = randn(&mut rng, n, 0.5, 1.0, dtype);
                let t = tensor::<Bastile<B>, 2>(&x, shape, dtype, device);
                for reduction in REDUCTIONS {
                    let out: Tensor<Bastile<B>, 1> = match reduction {
                        Reduction::Sum => t.clone().sum(),
                        Reduction::Mean => t.clone().mean(),
                        Reduction::Max => t.clone().max(),
                        Reduction::Min => t.clone().min(),
                    };
                    assert_eq!(out.dims(), [1]);
                    assert_eq!(out.dtype(), dtype);
                    let flat = reference(&x, [1, n, 1], 1, reduction);
                    let what = format!("{name} {dtype:?} {reduction:?} of all of {shape:?}");
                    if matches!(reduction, Reduction::Max | Reduction::Min) {
                        assert_eq!(values(out), flat, "{what}");
                    } else {
                        // Two launches round the rows' results to the
                        // dtype once more.
                        let tol = 2.0 * tolerance(kdtype(dtype));
                        assert_close(&what, &values(out), &flat, tol, seed);
                    }
                }
            }
        }
    }
}

/// `n` random ints in `[-bound, bound]`.
fn random_ints(rng: &mut Rng, n: usize, bound: i64) -> Vec<i64> {
    let span = (2 * bound + 1) as u64;
    (0..n)
        .map(|_| (rng.next_u64() % span) as i64 - bound)
        .collect()
}

fn int_values<X: burn::tensor::backend::Backend, const D: usize>(t: Tensor<X, D, Int>) -> Vec<i64> {
    t.into_data()
        .convert::<i64>()
        .to_vec::<i64>()
        .expect("i64 data")
}

backend_test! {
    fn reductions_of_ints_are_exact<B>(device, name, _dtypes) {
        let mut rng = Rng::fresh();
        let query = StorageQuery { dtype: DType::I32 };
        let op = IntReduceDim { reduction: Reduction::Sum, dim: 0 };
        assert!(bastile::fused::is_fused::<Bastile<B>, _>(&op, device, &query), "{name}");
        let int_reductions = [Reduction::Sum, Reduction::Max, Reduction::Min];
        let reduced = |t: Tensor<Bastile<B>, 3, Int>, reduction, dim| match reduction {
            Reduction::Sum => t.sum_dim(dim),
            Reduction::Max => t.max_dim(dim),
            _ => t.min_dim(dim),
        };
        // Along each dimension (a unit, a cube and a plane per output).
        for (shape, dim) in [([3usize, 37, 5], 1usize), ([1, 300, 5], 1), ([2, 130, 700], 2), ([4, 5, 6], 0)] {
            let x = random_ints(&mut rng, shape.iter().product(), 1000);
            let t = Tensor::<Bastile<B>, 3, Int>::from_data(TensorData::new(x.clone(), shape), device);
            let wide: Vec<f64> = x.iter().map(|&v| v as f64).collect();
            for reduction in int_reductions {
                let expected: Vec<i64> =
                    reference(&wide, shape, dim, reduction).iter().map(|&v| v as i64).collect();
                let mut dims = shape;
                dims[dim] = 1;
                let out = reduced(t.clone(), reduction, dim);
                assert_eq!(out.dims(), dims, "{name}");
                assert_eq!(int_values(out), expected, "{name} int {reduction:?} of {shape:?} over {dim}");
            }
        }
        // Whole: in one launch, in two, and through the backend's own op.
        for n in [1, 4097, ONE_LAUNCH_MAX, 67 * WHOLE_ROW, ONE_LAUNCH_MAX + 4] {
            let x = random_ints(&mut rng, n, 100);
            let t = Tensor::<Bastile<B>, 1, Int>::from_data(TensorData::new(x.clone(), [n]), device);
            let expected = [
                x.iter().sum::<i64>(),
                *x.iter().max().expect("values"),
                *x.iter().min().expect("values"),
            ];
            let got = [t.clone().sum(), t.clone().max(), t.min()].map(int_values);
            for ((reduction, got), expected) in int_reductions.iter().zip(got).zip(expected) {
                assert_eq!(got, vec![expected], "{name} int {reduction:?} of {n}");
            }
        }
    }
}
