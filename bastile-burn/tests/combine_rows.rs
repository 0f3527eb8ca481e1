//! Routed experts' rows combined per token (`bastile::combine_rows`):
//! `Bastile<B>` (its own node, one kernel per pass) against `B` (Burn's
//! gather, product and sum, their autodiff) and the f64 reference: the
//! output and the gradients of the rows and the weights, with every
//! choice's row shuffled among the rows and padding rows that no choice
//! holds (their gradient zero), a single choice per token, odd sizes.

use crate::common::*;
use bastile::{Bastile, BastileBackend, BastileError, combine_rows};
use bastile_cubecl::testing::{Rng, assert_close, assert_close_to_magnitude, tolerance};
use burn::backend::Autodiff;
use burn::tensor::{DType, Int, Tensor, TensorData};

/// The rows `[rows, hidden]`, weights `[tokens, top_k]`, the indices both
/// ways and the output gradient.
struct Problem {
    tokens: usize,
    top_k: usize,
    hidden: usize,
    rows: Vec<f64>,
    weights: Vec<f64>,
    row_of_slot: Vec<i64>,
    slot_of_row: Vec<i64>,
    dout: Vec<f64>,
}

impl Problem {
    /// Every choice its own row, shuffled, then `padding` rows no choice
    /// holds.
    fn new(rng: &mut Rng, [tokens, top_k, hidden, padding]: [usize; 4], dtype: DType) -> Self {
        let slots = tokens * top_k;
        let rows = slots + padding;
        let mut row_of_slot: Vec<i64> = (0..slots as i64).collect();
        rng.shuffle(&mut row_of_slot);
        let mut slot_of_row = vec![slots as i64; rows];
        for (s, &r) in row_of_slot.iter().enumerate() {
            slot_of_row[r as usize] = s as i64;
        }
        Self {
            tokens,
            top_k,
            hidden,
            rows: randn(rng, rows * hidden, 0.0, 1.0, dtype),
            weights: randn(rng, slots, 0.0, 0.5, dtype),
            row_of_slot,
            slot_of_row,
            dout: randn(rng, tokens * hidden, 0.0, 1.0, dtype),
        }
    }

    /// The f64 output and the gradients of the rows and the weights.
    fn reference(&self) -> [Vec<f64>; 3] {
        let (h, k) = (self.hidden, self.top_k);
        let row = |s: usize| &self.rows[self.row_of_slot[s] as usize * h..][..h];
        let out = (0..self.tokens * h)
            .map(|i| {
                let (t, c) = (i / h, i % h);
                (0..k)
                    .map(|j| self.weights[t * k + j] * row(t * k + j)[c])
                    .sum()
            })
            .collect();
        let slots = self.tokens * k;
        let drows = self
            .slot_of_row
            .iter()
            .flat_map(|&s| {
                let s = s as usize;
                (0..h).map(move |c| {
                    if s < slots {
                        self.weights[s] * self.dout[(s / k) * h + c]
                    } else {
                        0.0
                    }
                })
            })
            .collect();
        let dweights = (0..slots)
            .map(|s| (0..h).map(|c| self.dout[(s / k) * h + c] * row(s)[c]).sum())
            .collect();
        [out, drows, dweights]
    }

    /// The output and both gradients on `Autodiff<X>`.
    fn run<X: BastileBackend>(&self, dtype: DType, device: &X::Device) -> [Vec<f64>; 3] {
        type A<X> = Autodiff<X>;
        let (h, k, t) = (self.hidden, self.top_k, self.tokens);
        let rows_n = self.slot_of_row.len();
        let rows = tensor::<A<X>, 2>(&self.rows, [rows_n, h], dtype, device).require_grad();
        let weights = tensor::<A<X>, 2>(&self.weights, [t, k], dtype, device).require_grad();
        let row_of_slot = Tensor::<A<X>, 2, Int>::from_data(
            TensorData::new(self.row_of_slot.clone(), [t, k]),
            device,
        );
        let slot_of_row = Tensor::<A<X>, 1, Int>::from_data(
            TensorData::new(self.slot_of_row.clone(), [rows_n]),
            device,
        );
        let out = combine_rows(rows.clone(), weights.clone(), row_of_slot, slot_of_row).unwrap();
        assert_eq!(out.dtype(), dtype);
        let dout = tensor::<A<X>, 2>(&self.dout, [t, h], dtype, device);
        let grads = (out.clone() * dout).sum().backward();
        [
            values(out.inner()),
            values(rows.grad(&grads).expect("the rows' gradient")),
            values(weights.grad(&grads).expect("the weights' gradient")),
        ]
    }
}

backend_test! {
    fn combined_rows_and_their_gradients_match_reference<B>(device, name, dtypes) {
        let mut rng = Rng::fresh();
        let seed = rng.seed();
        for &dtype in dtypes {
            let query = bastile::fused::DTypeQuery { dtype };
            assert!(bastile::fused::is_fused::<Bastile<B>, _>(
                &bastile::ops::combine_rows::CombineRows,
                device,
                &query
            ));
            // [tokens, top_k, hidden, padding rows]
            for sizes in [[1usize, 1, 1, 0], [13, 4, 7, 5], [9, 1, 33, 3], [40, 4, 64, 17]] {
                let problem = Problem::new(&mut rng, sizes, dtype);
                let expected = problem.reference();
                // The composite rounds each weighted row before the sum.
                let tol = 4.0 * tolerance(kdtype(dtype));
                let what = format!("{name} {dtype:?} [tokens, top_k, hidden, padding] = {sizes:?}");
                let check = |path: &str, got: [Vec<f64>; 3]| {
                    assert_close(&format!("{path} output {what}"), &got[0], &expected[0], tol, seed);
                    assert_close(&format!("{path} rows' gradient {what}"), &got[1], &expected[1], tol, seed);
                    assert_close_to_magnitude(
                        &format!("{path} weights' gradient {what}"),
                        &got[2],
                        &expected[2],
                        tol,
                    );
                };
                let fused = problem.run::<Bastile<B>>(dtype, device);
                let padding = sizes[3] * sizes[2];
                assert!(
                    fused[1][fused[1].len() - padding..].iter().all(|&v| v == 0.0),
                    "a padding row's gradient is not zero: {what}"
                );
                check("fused", fused);
                if checks_composite(name) {
                    check("composite", problem.run::<B>(dtype, device));
                }
            }
        }
    }
}

#[test]
fn combine_rows_rejects_indices_of_other_shapes() {
    type B = Bastile<burn::backend::NdArray>;
    let device = Default::default();
    let rows = Tensor::<B, 2>::zeros([6, 3], &device);
    let weights = Tensor::<B, 2>::zeros([2, 2], &device);
    let err = combine_rows(
        rows.clone(),
        weights.clone(),
        Tensor::<B, 2, Int>::zeros([2, 3], &device),
        Tensor::<B, 1, Int>::zeros([6], &device),
    )
    .unwrap_err();
    assert!(
        matches!(&err, BastileError::Shape(m) if m.contains("row_of_slot [2, 3]")),
        "{err}"
    );
    let err = combine_rows(
        rows,
        weights,
        Tensor::<B, 2, Int>::zeros([2, 2], &device),
        Tensor::<B, 1, Int>::zeros([5], &device),
    )
    .unwrap_err();
    assert!(
        matches!(&err, BastileError::Shape(m) if m.contains("slot_of_row [5]")),
        "{err}"
    );
}
