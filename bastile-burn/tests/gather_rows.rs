//! Rows gathered by an invertible index (`bastile::gather_rows`):
//! `Bastile<B>` (its own node, whose backward gathers the gradient back
//! through the inverse) against `B` (Burn's `select`, whose backward
//! scatters) and the f64 reference, with every row copied `copies` times
//! as routed experts copy their tokens, padding rows that copy row 0 but
//! carry no gradient, rows nothing copies (their `sources` all padding, as
//! a group's padding rows are when expert outputs are gathered back), and
//! a row copied once.

use crate::common::*;
use bastile::{Bastile, BastileBackend, BastileError, gather_rows};
use bastile_cubecl::testing::{Rng, assert_close, tolerance};
use burn::backend::Autodiff;
use burn::tensor::{DType, Int, Tensor, TensorData};

/// `x` `[rows, hidden]`, the gather `index` `[out_rows]`, its inverse
/// `sources` `[rows, copies]` (the padding's entries are `out_rows`) and
/// the output gradient (zero on the padding rows, which nothing reads).
struct Problem {
    rows: usize,
    hidden: usize,
    copies: usize,
    x: Vec<f64>,
    index: Vec<i64>,
    sources: Vec<i64>,
    dout: Vec<f64>,
}

impl Problem {
    /// Every row but the last `uncopied` copied `copies` times to shuffled
    /// output rows, then `padding` rows copying row 0 that no source names.
    fn new(
        rng: &mut Rng,
        [copied_rows, hidden, copies, padding, uncopied]: [usize; 5],
        dtype: DType,
    ) -> Self {
        let rows = copied_rows + uncopied;
        let copied = copied_rows * copies;
        let out_rows = copied + padding;
        // A shuffle of the copied rows' places.
        let mut places: Vec<usize> = (0..copied).collect();
        rng.shuffle(&mut places);
        let mut index = vec![0i64; out_rows];
        // The uncopied rows' entries name no row (`out_rows`).
        let mut sources = vec![out_rows as i64; rows * copies];
        for (k, &place) in places.iter().enumerate() {
            index[place] = (k / copies) as i64;
            sources[k] = place as i64;
        }
        let mut dout = randn(rng, out_rows * hidden, 0.0, 1.0, dtype);
        dout[copied * hidden..].fill(0.0);
        Self {
            rows,
            hidden,
            copies,
            x: randn(rng, rows * hidden, 0.0, 1.0, dtype),
            index,
            sources,
            dout,
        }
    }

    /// The f64 rows gathered and the gradient of `x`.
    fn reference(&self) -> [Vec<f64>; 2] {
        let h = self.hidden;
        let gathered = self
            .index
            .iter()
            .flat_map(|&r| self.x[r as usize * h..][..h].to_vec())
            .collect();
        let mut dx = vec![0.0; self.rows * h];
        let out_rows = self.index.len() as i64;
        for (k, &place) in self.sources.iter().enumerate() {
            if place == out_rows {
                continue;
            }
            let r = k / self.copies;
            for j in 0..h {
                dx[r * h + j] += self.dout[place as usize * h + j];
            }
        }
        [gathered, dx]
    }

    /// The rows gathered and the gradient of `x` on `Autodiff<X>`.
    fn run<X: BastileBackend>(&self, dtype: DType, device: &X::Device) -> [Vec<f64>; 2] {
        type A<X> = Autodiff<X>;
        let (h, out_rows) = (self.hidden, self.index.len());
        let x = tensor::<A<X>, 2>(&self.x, [self.rows, h], dtype, device).require_grad();
        let index = Tensor::<A<X>, 1, Int>::from_data(
            TensorData::new(self.index.clone(), [out_rows]),
            device,
        );
        let sources = Tensor::<A<X>, 2, Int>::from_data(
            TensorData::new(self.sources.clone(), [self.rows, self.copies]),
            device,
        );
        let out = gather_rows(x.clone(), index, sources).unwrap();
        assert_eq!(out.dtype(), dtype);
        let dout = tensor::<A<X>, 2>(&self.dout, [out_rows, h], dtype, device);
        let grads = (out.clone() * dout).sum().backward();
        [
            values(out.inner()),
            values(x.grad(&grads).expect("x's gradient")),
        ]
    }
}

backend_test! {
    fn gathered_rows_and_their_gradient_match_reference<B>(device, name, dtypes) {
        let mut rng = Rng::fresh();
        let seed = rng.seed();
        for &dtype in dtypes {
            let query = bastile::fused::DTypeQuery { dtype };
            assert!(bastile::fused::is_fused::<Bastile<B>, _>(
                &bastile::ops::gather_rows::GatherRows,
                device,
                &query
            ));
            // [copied rows, hidden, copies, padding, uncopied rows]:
            // routed-expert shapes (each token in top-k groups, groups
            // padded; expert rows gathered back, the padding's gathering
            // nothing), a row copied once, odd sizes.
            for sizes in [[1usize, 1, 1, 0, 0], [13, 7, 4, 5, 0], [9, 33, 1, 3, 4], [6, 40, 1, 0, 5]] {
                let problem = Problem::new(&mut rng, sizes, dtype);
                let expected = problem.reference();
                // A row's gradient rounds once per copy added to it.
                let tol = 4.0 * tolerance(kdtype(dtype));
                let what = format!(
                    "{name} {dtype:?} [copied rows, hidden, copies, padding, uncopied] = {sizes:?}"
                );
                let fused = problem.run::<Bastile<B>>(dtype, device);
                // Gathering copies rows: exact.
                assert_eq!(fused[0], expected[0], "rows {what}");
                assert_close(&format!("x gradient {what}"), &fused[1], &expected[1], tol, seed);
                if checks_composite(name) {
                    let composite = problem.run::<B>(dtype, device);
                    assert_eq!(composite[0], expected[0], "composite rows {what}");
                    assert_close(&format!("composite x gradient {what}"), &composite[1], &expected[1], tol, seed);
                }
            }
        }
    }
}

#[test]
fn gather_rows_rejects_an_inverse_of_another_height() {
    type B = Bastile<burn::backend::NdArray>;
    let device = Default::default();
    let x = Tensor::<B, 2>::zeros([4, 3], &device);
    let index = Tensor::<B, 1, Int>::zeros([6], &device);
    let sources = Tensor::<B, 2, Int>::zeros([5, 2], &device);
    let err = gather_rows(x, index, sources).unwrap_err();
    assert!(
        matches!(&err, BastileError::Shape(m) if m.contains("sources [rows, copies]")),
        "{err}"
    );
}
