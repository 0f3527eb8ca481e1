//! The column sum that finishes the two-stage parameter gradients (the
//! RMSNorm weight's) against the f64 reference: one row, no row (zeros),
//! odd widths (scalar columns), more rows than a cube has lanes, more
//! columns than a cube holds, f32 partials summed into every output dtype,
//! a NaN-poisoned output (and, without rows, a NaN row that must not be
//! read); and the same partials summed twice give the same bits.

use bastile_cubecl::FloatDtype;
use bastile_cubecl::reduce::column_sum;
use bastile_cubecl::testing::*;
use cubecl::prelude::*;

/// `[rows, cols]` of the f32 partials.
type Case = [usize; 2];

fn check<R: Runtime>(
    client: &ComputeClient<R>,
    [rows, cols]: Case,
    dtype: FloatDtype,
    rng: &mut Rng,
) {
    let seed = rng.seed();
    let what = format!("column sum [{rows}, {cols}] into {dtype} seed {seed}");
    let partials = rounded(rng, FloatDtype::F32, rows * cols, 1.0);
    let expected: Vec<f64> = (0..cols)
        .map(|c| round_to(dtype, (0..rows).map(|r| partials[r * cols + c]).sum()))
        .collect();
    // Without rows the buffer holds one NaN row that must not be read.
    let input = if rows == 0 {
        poisoned(client, FloatDtype::F32, cols)
    } else {
        upload(client, FloatDtype::F32, &partials)
    };
    let sum = |client: &ComputeClient<R>| {
        let out = poisoned(client, dtype, cols);
        column_sum(client, &input, &out, rows, cols, dtype).unwrap();
        download(client, dtype, out)
    };
    let actual = sum(client);
    // Summed in f32 and rounded once: within one rounding of the f64 sum
    // (f32 sums of `rows` unit normals carry about sqrt(rows) ulps more).
    let tol = tolerance(dtype).max(1e-6 * (rows as f64).sqrt());
    if rows == 0 {
        assert!(
            actual.iter().all(|&v| v == 0.0),
            "no rows must sum to zero: {what}: {actual:?}"
        );
    } else {
        assert_close_to_magnitude(&what, &actual, &expected, tol);
    }
    let again = sum(client);
    assert!(
        actual
            .iter()
            .zip(&again)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "two sums of the same partials differ: {what}"
    );
}

struct ColumnSum;

impl RuntimeTest for ColumnSum {
    fn run<R: Runtime>(&self, device: &R::Device, _runtime: &str, dtypes: &[FloatDtype]) {
        let client = R::client(device);
        let mut rng = Rng::fresh();
        let cases: [Case; 7] = [
            [1, 1],
            [0, 8],
            [3, 37],
            [528, 128],
            [1000, 7],
            [61, 1024],
            [5, 4100],
        ];
        for &dtype in &supported_dtypes(&client, dtypes) {
            for case in cases {
                check(&client, case, dtype, &mut rng);
            }
        }
    }
}

#[test]
fn column_sums_match_reference() {
    for_each_runtime(&ColumnSum);
}
