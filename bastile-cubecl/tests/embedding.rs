//! The embedding gradient kernel against the f64 reference: rows that many
//! tokens share (each add rounded in token order), ids out of range that
//! must add nothing, padded row pitches whose NaN padding must be neither
//! read nor written, and buffers too short for the problem refused.

use bastile_cubecl::embedding::{self, EmbeddingGradBuffers, EmbeddingGradProblem};
use bastile_cubecl::launch::gcd;
use bastile_cubecl::reference::embedding as reference;
use bastile_cubecl::rows::Rows;
use bastile_cubecl::testing::*;
use bastile_cubecl::{FloatDtype, KernelError};
use cubecl::prelude::*;

/// `[tokens, vocab, hidden, grad row padding, dout row padding]`.
type Case = [usize; 5];

fn check<R: Runtime>(client: &ComputeClient<R>, case: Case, dtype: FloatDtype, rng: &mut Rng) {
    let [tokens, vocab, hidden, grad_pad, dout_pad] = case;
    let seed = rng.seed();
    let what = format!("{case:?} {dtype} seed {seed}");
    // Ids from the first third of the vocabulary (rows shared by many
    // tokens), with every eleventh token out of range on either side.
    let ids: Vec<i32> = (0..tokens)
        .map(|t| match t % 11 {
            5 => -1 - (t % 3) as i32,
            10 => (vocab + t % 4) as i32,
            _ => (rng.uniform() * vocab.div_ceil(3) as f64) as i32,
        })
        .collect();
    let grad = rounded(rng, dtype, vocab * hidden, 1.0);
    let dout = rounded(rng, dtype, tokens * hidden, 1.0);
    let expected = reference::add_rows(&grad, &ids, &dout, hidden, |v| round_to(dtype, v));

    let (grad_stride, dout_stride) = (hidden + grad_pad, hidden + dout_pad);
    let problem = EmbeddingGradProblem {
        tokens,
        vocab,
        hidden,
        dtype,
        stride_multiple: gcd(gcd(hidden, grad_stride), dout_stride),
    };
    let matrix = |values: &[f64], stride: usize| Rows {
        handle: upload(client, dtype, &pad_rows(values, hidden, stride)),
        stride,
    };
    let buffers = EmbeddingGradBuffers {
        grad: matrix(&grad, grad_stride),
        ids: upload_i32(client, &ids),
        dout: matrix(&dout, dout_stride),
    };
    embedding::add_rows(client, &problem, &buffers).unwrap();
    let actual = unpad_rows(
        download(client, dtype, buffers.grad.handle.clone()),
        hidden,
        grad_stride,
        &what,
    );
    // Rows no in-range token names are untouched, exactly.
    for (r, (a, g)) in actual.chunks(hidden).zip(grad.chunks(hidden)).enumerate() {
        if !ids.contains(&(r as i32)) {
            assert_eq!(a, g, "row {r} has no token but changed: {what}");
        }
    }
    assert_close(&what, &actual, &expected, tolerance(dtype), seed);

    // One id too few, one output-gradient row too few: refused.
    if tokens < 2 {
        return;
    }
    let short_ids = EmbeddingGradBuffers {
        ids: upload_i32(client, &ids[..tokens - 1]),
        ..buffers.clone()
    };
    assert!(matches!(
        embedding::add_rows(client, &problem, &short_ids),
        Err(KernelError::Shape(e)) if e.contains("embedding ids")
    ));
    let short_dout = EmbeddingGradBuffers {
        dout: matrix(&dout[..(tokens - 1) * hidden], dout_stride),
        ..buffers
    };
    assert!(matches!(
        embedding::add_rows(client, &problem, &short_dout),
        Err(KernelError::Shape(e)) if e.contains("embedding output gradient")
    ));
}

struct AddRows;

impl RuntimeTest for AddRows {
    fn run<R: Runtime>(&self, device: &R::Device, _runtime: &str, dtypes: &[FloatDtype]) {
        let client = R::client(device);
        let mut rng = Rng::fresh();
        let cases: [Case; 4] = [
            [1, 1, 1, 0, 0],
            [37, 23, 19, 3, 5],
            [300, 50, 64, 0, 8],
            [2048, 700, 96, 0, 0],
        ];
        for &dtype in &supported_dtypes(&client, dtypes) {
            for case in cases {
                check(&client, case, dtype, &mut rng);
            }
        }
    }
}

#[test]
fn embedding_gradient_matches_reference() {
    for_each_runtime(&AddRows);
}
