//! A batch of linear layers (`batched_linear`, a mixture's experts) on
//! `Bastile<B>` (one fused node; on CUDA one cuBLASLt product per pass with
//! each layer's bias in its epilogue) and on `B` (Burn's ops), against an
//! f64 reference written here: values and the gradients of the input, the
//! weights and the biases (frozen ones get none), with odd sizes, a single
//! layer, a single row, and an input broadcast to every layer (the dense
//! expert path), whose gradient sums over the layers.

use crate::common::*;
use bastile::{Bastile, BastileBackend, BastileError, batched_linear};
use bastile_cubecl::testing::{Rng, tolerance};
use burn::backend::Autodiff;
use burn::tensor::{DType, Tensor};

/// One problem: `layers` layers of `[inp, out]` on `rows` rows each.
struct Problem {
    layers: usize,
    rows: usize,
    inp: usize,
    out: usize,
    /// `[layers, rows, inp]`, or `[rows, inp]` broadcast to every layer.
    x: Vec<f64>,
    broadcast: bool,
    w: Vec<f64>,
    bias: Vec<f64>,
    /// The output's gradient, `[layers, rows, out]`.
    g: Vec<f64>,
}

impl Problem {
    fn x_at(&self, l: usize, r: usize, i: usize) -> f64 {
        let l = if self.broadcast { 0 } else { l };
        self.x[(l * self.rows + r) * self.inp + i]
    }

    /// `[y, dx, dW, dbias]`, each value with the sum of its terms'
    /// magnitudes (`abs` maps every input through `f64::abs`).
    fn reference(&self, abs: bool) -> Vec<Vec<f64>> {
        let v = |x: f64| if abs { x.abs() } else { x };
        let (ls, rs, is, os) = (self.layers, self.rows, self.inp, self.out);
        let w = |l: usize, i: usize, o: usize| v(self.w[(l * is + i) * os + o]);
        let g = |l: usize, r: usize, o: usize| v(self.g[(l * rs + r) * os + o]);
        let x = |l, r, i| v(self.x_at(l, r, i));
        let mut y = vec![0.0; ls * rs * os];
        let mut dx = vec![
            0.0;
            if self.broadcast {
                rs * is
            } else {
                ls * rs * is
            }
        ];
        let mut dw = vec![0.0; ls * is * os];
        let mut db = vec![0.0; ls * os];
        for l in 0..ls {
            for r in 0..rs {
                for o in 0..os {
                    let mut sum = v(self.bias[l * os + o]);
                    for i in 0..is {
                        sum += x(l, r, i) * w(l, i, o);
                    }
                    y[(l * rs + r) * os + o] = sum;
                    db[l * os + o] += g(l, r, o);
                }
                for i in 0..is {
                    let at = if self.broadcast {
                        r * is + i
                    } else {
                        (l * rs + r) * is + i
                    };
                    dx[at] += (0..os).map(|o| g(l, r, o) * w(l, i, o)).sum::<f64>();
                    for o in 0..os {
                        dw[(l * is + i) * os + o] += x(l, r, i) * g(l, r, o);
                    }
                }
            }
        }
        vec![y, dx, dw, db]
    }

    /// `[y, dx, dW, dbias]` of `batched_linear` on `Autodiff<X>` (only `[y,
    /// dx]` with frozen weights, which must get no gradient).
    fn run<X: BastileBackend>(
        &self,
        trained: bool,
        dtype: DType,
        device: &X::Device,
    ) -> Vec<Vec<f64>> {
        type A<X> = Autodiff<X>;
        let (ls, rs, is, os) = (self.layers, self.rows, self.inp, self.out);
        let x = if self.broadcast {
            tensor::<A<X>, 2>(&self.x, [rs, is], dtype, device).require_grad()
        } else {
            tensor::<A<X>, 2>(&self.x, [ls * rs, is], dtype, device).require_grad()
        };
        let input = if self.broadcast {
            x.clone().unsqueeze::<3>().expand([ls, rs, is])
        } else {
            x.clone().reshape([ls, rs, is])
        };
        let (mut w, mut bias) = (
            tensor::<A<X>, 3>(&self.w, [ls, is, os], dtype, device),
            tensor::<A<X>, 2>(&self.bias, [ls, os], dtype, device),
        );
        if trained {
            (w, bias) = (w.require_grad(), bias.require_grad());
        }
        let y = batched_linear(input, w.clone(), Some(bias.clone())).unwrap();
        assert_eq!(y.dtype(), dtype);
        let g = tensor::<A<X>, 3>(&self.g, [ls, rs, os], dtype, device);
        let grads = (y.clone() * g).sum().backward();
        let mut out = vec![values(y.inner()), values(x.grad(&grads).expect("dx"))];
        if trained {
            out.push(values(w.grad(&grads).expect("dW")));
            out.push(values(bias.grad(&grads).expect("dbias")));
        } else {
            assert!(w.grad(&grads).is_none() && bias.grad(&grads).is_none());
        }
        out
    }
}

backend_test! {
    fn batched_linear_fused_and_composite_match_reference<B>(device, name, dtypes) {
        let mut rng = Rng::fresh();
        let seed = rng.seed();
        for &dtype in dtypes {
            let query = bastile::fused::DTypeQuery { dtype };
            assert!(bastile::fused::is_fused::<Bastile<B>, _>(&bastile::ops::linear::Linear, device, &query));
            // [layers, rows, in, out, broadcast]
            for [layers, rows, inp, out, broadcast] in
                [[1usize, 1, 1, 1, 0], [3, 7, 5, 9, 0], [4, 33, 67, 29, 0], [3, 6, 13, 11, 1]]
            {
                let broadcast = broadcast == 1;
                let x_len = if broadcast { rows * inp } else { layers * rows * inp };
                let problem = Problem {
                    layers,
                    rows,
                    inp,
                    out,
                    x: randn(&mut rng, x_len, 0.0, 1.0, dtype),
                    broadcast,
                    w: randn(&mut rng, layers * inp * out, 0.0, 0.3, dtype),
                    bias: randn(&mut rng, layers * out, 0.0, 1.0, dtype),
                    g: randn(&mut rng, layers * rows * out, 0.0, 1.0, dtype),
                };
                let (expected, magnitude) = (problem.reference(false), problem.reference(true));
                let tol = tolerance(kdtype(dtype));
                let composite_tol = if name.starts_with("cuda") { tol.max(2e-3) } else { tol };
                for trained in [false, true] {
                    let what = format!(
                        "{name} {dtype:?} trained {trained} [layers, rows, in, out] = {:?}, broadcast {broadcast}",
                        [layers, rows, inp, out]
                    );
                    let fused = problem.run::<Bastile<B>>(trained, dtype, device);
                    let composite = checks_composite(name).then(|| problem.run::<B>(trained, dtype, device));
                    for (k, part) in ["y", "dx", "dW", "dbias"].into_iter().enumerate().take(fused.len()) {
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

backend_test! {
    fn batched_linear_rejects_mismatched_inputs<B>(device, _name, _dtypes) {
        let zeros = |shape: [usize; 3]| Tensor::<Bastile<B>, 3>::zeros(shape, device);
        let bias = |shape: [usize; 2]| Some(Tensor::<Bastile<B>, 2>::zeros(shape, device));
        let x = zeros([3, 4, 5]);
        let shape = |r: Result<Tensor<Bastile<B>, 3>, BastileError>| matches!(r, Err(BastileError::Shape(_)));
        // Another layer count, another input width, a bias of another
        // layer count or width.
        assert!(shape(batched_linear(x.clone(), zeros([2, 5, 6]), None)));
        assert!(shape(batched_linear(x.clone(), zeros([3, 4, 6]), None)));
        assert!(shape(batched_linear(x.clone(), zeros([3, 5, 6]), bias([2, 6]))));
        assert!(shape(batched_linear(x.clone(), zeros([3, 5, 6]), bias([3, 5]))));
        assert!(matches!(
            batched_linear(x.clone(), zeros([3, 5, 6]).cast(DType::F16), None),
            Err(BastileError::DType(_))
        ));
        assert!(matches!(
            batched_linear(x.clone(), zeros([3, 5, 6]), bias([3, 6]).map(|b| b.cast(DType::F16))),
            Err(BastileError::DType(_))
        ));
        assert_eq!(batched_linear(x, zeros([3, 5, 6]), bias([3, 6])).unwrap().dims(), [3, 4, 6]);
    }
}
