//! The embedding lookup through Burn: `Bastile<B>` (its own node, whose
//! backward adds into the weight's existing gradient) against `B` (Burn's
//! node) and the f64 reference: the rows looked up, and the weight's
//! gradient alone, tied to an output layer (its gradient registered
//! first), and when the earlier gradient is shared with another tensor
//! (which must keep its own).

use crate::common::*;
use bastile::{Bastile, BastileBackend, BastileError, add_embedding_grad, embedding};
use bastile_cubecl::testing::{Rng, assert_close, tolerance};
use burn::backend::Autodiff;
use burn::tensor::{DType, Int, Tensor, TensorData};

/// What else uses the weight besides the lookup.
#[derive(Clone, Copy, Debug)]
enum Tied {
    /// Nothing: the lookup's gradient alone.
    Alone,
    /// An output layer `x · Wᵀ` after the lookup (its gradient comes first
    /// in the backward pass, as a tied LM head's does).
    Head,
    /// `W + V` after the lookup: the earlier gradient is the same tensor
    /// as `V`'s.
    SharedWithOther,
}

/// The random inputs: weight `[vocab, hidden]`, ids `[batch, seq]`, the
/// lookup's output gradient, the head input `[tokens, hidden]` and output
/// gradient `[tokens, vocab]`, the sum's gradient `[vocab, hidden]`.
struct Problem {
    vocab: usize,
    hidden: usize,
    batch: usize,
    seq: usize,
    w: Vec<f64>,
    ids: Vec<i64>,
    dout: Vec<f64>,
    x: Vec<f64>,
    dhead: Vec<f64>,
    dsum: Vec<f64>,
}

impl Problem {
    fn new(rng: &mut Rng, [vocab, hidden, batch, seq]: [usize; 4], dtype: DType) -> Self {
        let tokens = batch * seq;
        // f32 problems take values f16 holds (TF32's 10 mantissa bits):
        // the composite's f32 product on CUDA is then exact.
        let dtype = match dtype {
            DType::F32 => DType::F16,
            other => other,
        };
        // Ids from the first third of the vocabulary: rows repeat, and
        // the other rows get no gradient from the lookup.
        let ids = (0..tokens)
            .map(|_| (rng.uniform() * (vocab / 3) as f64) as i64)
            .collect();
        Self {
            vocab,
            hidden,
            batch,
            seq,
            w: randn(rng, vocab * hidden, 0.0, 1.0, dtype),
            ids,
            dout: randn(rng, tokens * hidden, 0.0, 1.0, dtype),
            x: randn(rng, tokens * hidden, 0.0, 1.0, dtype),
            dhead: randn(rng, tokens * vocab, 0.0, 1.0, dtype),
            dsum: randn(rng, vocab * hidden, 0.0, 1.0, dtype),
        }
    }

    /// The f64 rows looked up, the weight's gradient and `V`'s.
    fn reference(&self, tied: Tied) -> [Vec<f64>; 3] {
        self.weight_gradient(tied, |v| v)
    }

    /// For each element of the weight's gradient, the sum of its terms'
    /// magnitudes: what its rounding errors scale with, since the terms
    /// can cancel (with one token and a tied head, the gradient is two
    /// products of random values).
    fn magnitude(&self, tied: Tied) -> Vec<f64> {
        let [_, magnitude, _] = self.weight_gradient(tied, f64::abs);
        magnitude
    }

    /// The rows, the weight's gradient with each term passed through
    /// `term`, and `V`'s gradient.
    fn weight_gradient(&self, tied: Tied, term: fn(f64) -> f64) -> [Vec<f64>; 3] {
        let (v, h) = (self.vocab, self.hidden);
        let rows = self
            .ids
            .iter()
            .flat_map(|&id| self.w[id as usize * h..][..h].to_vec())
            .collect();
        let mut dw = vec![0.0; v * h];
        for (t, &id) in self.ids.iter().enumerate() {
            for j in 0..h {
                dw[id as usize * h + j] += term(self.dout[t * h + j]);
            }
        }
        match tied {
            Tied::Alone => {}
            Tied::Head => {
                for (t, x) in self.x.chunks(h).enumerate() {
                    for (r, row) in dw.chunks_mut(h).enumerate() {
                        let g = self.dhead[t * v + r];
                        row.iter_mut().zip(x).for_each(|(d, x)| *d += term(g * x));
                    }
                }
            }
            Tied::SharedWithOther => dw
                .iter_mut()
                .zip(&self.dsum)
                .for_each(|(d, s)| *d += term(*s)),
        }
        let dother = match tied {
            Tied::SharedWithOther => self.dsum.clone(),
            _ => vec![],
        };
        [rows, dw, dother]
    }

    /// The rows, the weight's gradient and `V`'s on `Autodiff<X>`.
    fn run<X: BastileBackend>(
        &self,
        tied: Tied,
        dtype: DType,
        device: &X::Device,
    ) -> [Vec<f64>; 3] {
        type A<X> = Autodiff<X>;
        let (v, h, tokens) = (self.vocab, self.hidden, self.batch * self.seq);
        let w = tensor::<A<X>, 2>(&self.w, [v, h], dtype, device).require_grad();
        let ids = Tensor::<A<X>, 2, Int>::from_data(
            TensorData::new(self.ids.clone(), [self.batch, self.seq]),
            device,
        );
        let rows = embedding(w.clone(), ids).unwrap();
        assert_eq!(rows.dtype(), dtype);
        let dout = tensor::<A<X>, 3>(&self.dout, [self.batch, self.seq, h], dtype, device);
        let mut loss = (rows.clone() * dout).sum();
        let other = tensor::<A<X>, 2>(&self.dsum, [v, h], dtype, device).require_grad();
        match tied {
            Tied::Alone => {}
            Tied::Head => {
                let x = tensor::<A<X>, 2>(&self.x, [tokens, h], dtype, device);
                let dhead = tensor::<A<X>, 2>(&self.dhead, [tokens, v], dtype, device);
                loss = loss + (x.matmul(w.clone().transpose()) * dhead).sum();
            }
            Tied::SharedWithOther => {
                let dsum = tensor::<A<X>, 2>(&self.dsum, [v, h], dtype, device);
                loss = loss + ((w.clone() + other.clone()) * dsum).sum();
            }
        }
        let grads = loss.backward();
        let dother = match tied {
            Tied::SharedWithOther => values(other.grad(&grads).expect("V's gradient")),
            _ => vec![],
        };
        [
            values(rows.inner()),
            values(w.grad(&grads).expect("the weight's gradient")),
            dother,
        ]
    }
}

backend_test! {
    fn embedding_gradient_adds_into_the_earlier_gradient<B>(device, name, dtypes) {
        let mut rng = Rng::fresh();
        let seed = rng.seed();
        for &dtype in dtypes {
            let query = bastile::fused::DTypeQuery { dtype };
            assert!(bastile::fused::is_fused::<Bastile<B>, _>(
                &bastile::ops::embedding::Embedding,
                device,
                &query
            ));
            for sizes in [[1usize, 1, 1, 1], [37, 19, 2, 9]] {
                let problem = Problem::new(&mut rng, sizes, dtype);
                for tied in [Tied::Alone, Tied::Head, Tied::SharedWithOther] {
                    let expected = problem.reference(tied);
                    // A row's gradient rounds once per token added to it
                    // (at most a few here) and once for the other term.
                    let tol = 4.0 * tolerance(kdtype(dtype));
                    let what = format!("{name} {dtype:?} {tied:?} [vocab, hidden, batch, seq] = {sizes:?}");
                    let fused = problem.run::<Bastile<B>>(tied, dtype, device);
                    let composite =
                        checks_composite(name).then(|| problem.run::<B>(tied, dtype, device));
                    // The lookup copies rows: exact.
                    assert_eq!(fused[0], expected[0], "rows {what}");
                    let magnitude = problem.magnitude(tied);
                    assert_within(&format!("weight gradient {what}"), &fused[1], &expected[1], &magnitude, tol, seed);
                    // `V`'s gradient is the sum's, untouched by the lookup's
                    // rows added to the weight's.
                    assert_eq!(fused[2], expected[2], "the other tensor's gradient {what}");
                    if let Some(c) = composite {
                        assert_eq!(c[0], expected[0], "composite rows {what}");
                        assert_within(&format!("composite weight gradient {what}"), &c[1], &expected[1], &magnitude, tol, seed);
                        assert_eq!(c[2], expected[2], "composite: the other tensor's gradient {what}");
                    }
                }
            }
        }
    }
}

#[test]
fn add_embedding_grad_matches_reference_and_rejects_bad_shapes() {
    type B = Bastile<burn::backend::NdArray>;
    let device = Default::default();
    let mut rng = Rng::fresh();
    let problem = Problem::new(&mut rng, [11, 5, 2, 7], DType::F32);
    let expected = problem.reference(Tied::SharedWithOther)[1].clone();
    let (v, h) = (problem.vocab, problem.hidden);
    let start = tensor::<B, 2>(&problem.dsum, [v, h], DType::F32, &device);
    let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(problem.ids.clone(), [2, 7]), &device);
    let dout = tensor::<B, 3>(&problem.dout, [2, 7, h], DType::F32, &device);
    let grad = add_embedding_grad(start.clone(), ids.clone(), dout.clone()).unwrap();
    assert_close(
        "add_embedding_grad",
        &values(grad),
        &expected,
        1e-6,
        rng.seed(),
    );

    let shape = |r: Result<Tensor<B, 2>, BastileError>| matches!(r, Err(BastileError::Shape(_)));
    assert!(shape(add_embedding_grad(
        start.clone(),
        ids.clone(),
        Tensor::zeros([2, 7, h + 1], &device)
    )));
    assert!(shape(add_embedding_grad(start, ids.reshape([7, 2]), dout)));
}
