//! The gather-sum kernel (a row gather's backward pass) against the f64
//! reference: rows summing up to several copies, entries out of range
//! (padding) that must add nothing, rows with no entry in range (written
//! as zero), padded row pitches whose NaN padding must be neither read nor
//! written, a NaN-poisoned output, and buffers too short refused.

use bastile_cubecl::gather::{self, GatherSumBuffers, GatherSumProblem};
use bastile_cubecl::launch::gcd;
use bastile_cubecl::rows::Rows;
use bastile_cubecl::testing::*;
use bastile_cubecl::{FloatDtype, KernelError};
use cubecl::prelude::*;

/// `[rows, copies, src_rows, hidden, src row padding, out row padding]`.
type Case = [usize; 6];

fn check<R: Runtime>(client: &ComputeClient<R>, case: Case, dtype: FloatDtype, rng: &mut Rng) {
    let [rows, copies, src_rows, hidden, src_pad, out_pad] = case;
    let seed = rng.seed();
    let what = format!("{case:?} {dtype} seed {seed}");
    // Source rows drawn at random, with every seventh entry out of range
    // on either side (the padding names `src_rows`), and the last row's
    // entries all padding.
    let index: Vec<i32> = (0..rows * copies)
        .map(|e| match (e / copies == rows - 1 && rows > 1, e % 7) {
            (true, _) => src_rows as i32,
            (false, 3) => src_rows as i32 + (e % 2) as i32,
            (false, 6) => -1,
            _ => (rng.uniform() * src_rows as f64).min(src_rows as f64 - 1.0) as i32,
        })
        .collect();
    let src = rounded(rng, dtype, src_rows * hidden, 1.0);
    let expected: Vec<f64> = (0..rows * hidden)
        .map(|i| {
            let (r, j) = (i / hidden, i % hidden);
            let sum: f64 = index[r * copies..(r + 1) * copies]
                .iter()
                .filter(|&&e| e >= 0 && (e as usize) < src_rows)
                .map(|&e| src[e as usize * hidden + j])
                .sum();
            round_to(dtype, sum)
        })
        .collect();

    let (src_stride, out_stride) = (hidden + src_pad, hidden + out_pad);
    let problem = GatherSumProblem {
        rows,
        copies,
        src_rows,
        hidden,
        dtype,
        stride_multiple: gcd(gcd(hidden, src_stride), out_stride),
    };
    let buffers = GatherSumBuffers {
        src: Rows {
            handle: upload(client, dtype, &pad_rows(&src, hidden, src_stride)),
            stride: src_stride,
        },
        index: upload_i32(client, &index),
        out: Rows {
            handle: poisoned(client, dtype, rows * out_stride),
            stride: out_stride,
        },
    };
    gather::gather_sum(client, &problem, &buffers).unwrap();
    let actual = unpad_rows(
        download(client, dtype, buffers.out.handle.clone()),
        hidden,
        out_stride,
        &what,
    );
    // Copies summed in f32 and rounded once: within one rounding of the
    // f64 sum.
    assert_close(&what, &actual, &expected, tolerance(dtype), seed);
    if rows > 1 {
        let last = &actual[(rows - 1) * hidden..];
        assert!(
            last.iter().all(|&v| v == 0.0),
            "a row with only padding entries is not zero: {what}"
        );
    }

    // One index entry too few, one source row too few: refused.
    let short_index = GatherSumBuffers {
        index: upload_i32(client, &index[..rows * copies - 1]),
        ..buffers.clone()
    };
    assert!(matches!(
        gather::gather_sum(client, &problem, &short_index),
        Err(KernelError::Shape(e)) if e.contains("gather index")
    ));
    let short_src = GatherSumBuffers {
        src: Rows {
            handle: upload(client, dtype, &vec![0.0; (src_rows - 1) * src_stride]),
            stride: src_stride,
        },
        ..buffers
    };
    assert!(matches!(
        gather::gather_sum(client, &problem, &short_src),
        Err(KernelError::Shape(e)) if e.contains("gathered source")
    ));
}

struct GatherSum;

impl RuntimeTest for GatherSum {
    fn run<R: Runtime>(&self, device: &R::Device, _runtime: &str, dtypes: &[FloatDtype]) {
        let client = R::client(device);
        let mut rng = Rng::fresh();
        let cases: [Case; 4] = [
            [1, 1, 1, 1, 0, 0],
            [13, 4, 60, 7, 3, 5],
            [57, 1, 40, 64, 0, 8],
            [300, 4, 1200, 96, 0, 0],
        ];
        for &dtype in &supported_dtypes(&client, dtypes) {
            for case in cases {
                check(&client, case, dtype, &mut rng);
            }
        }
    }
}

#[test]
fn gathered_sums_match_reference() {
    for_each_runtime(&GatherSum);
}
