//! Routed experts' rows combined per token, and both gradients, against
//! the f64 reference: choices whose rows lie outside the rows (adding
//! nothing), padding rows no choice holds (a zero gradient), padded row
//! pitches, NaN-poisoned outputs, odd sizes, and buffers too short
//! refused.

use bastile_cubecl::combine::{
    self, CombineBuffers, CombineProblem, CombineRowsGradBuffers, CombineWeightsGradBuffers,
};
use bastile_cubecl::launch::gcd;
use bastile_cubecl::rows::Rows;
use bastile_cubecl::testing::*;
use bastile_cubecl::{FloatDtype, KernelError};
use cubecl::prelude::*;

/// `[tokens, top_k, padding rows, hidden, row pitch padding]`.
type Case = [usize; 5];

fn check<R: Runtime>(client: &ComputeClient<R>, case: Case, dtype: FloatDtype, rng: &mut Rng) {
    let [tokens, top_k, padding, hidden, pad] = case;
    let seed = rng.seed();
    let what = format!("{case:?} {dtype} seed {seed}");
    let slots = tokens * top_k;
    // Every choice its own row, shuffled, then `padding`
    // rows no choice holds; every seventh choice names a row past the
    // rows instead (it adds nothing, and its row is padding too).
    let rows = slots + padding;
    let mut row_of_slot: Vec<i32> = (0..slots as i32).collect();
    rng.shuffle(&mut row_of_slot);
    let mut slot_of_row = vec![slots as i32; rows];
    for (s, r) in row_of_slot.iter_mut().enumerate() {
        if s % 7 == 3 {
            *r = rows as i32 + (s % 2) as i32;
        } else {
            slot_of_row[*r as usize] = s as i32;
        }
    }
    let values = rounded(rng, dtype, rows * hidden, 1.0);
    let weights = rounded(rng, dtype, slots, 0.5);
    let dout = rounded(rng, dtype, tokens * hidden, 1.0);
    let in_rows = |r: i32| r >= 0 && (r as usize) < rows;

    let out: Vec<f64> = (0..tokens * hidden)
        .map(|i| {
            let (t, c) = (i / hidden, i % hidden);
            let sum: f64 = (0..top_k)
                .map(|j| t * top_k + j)
                .filter(|&s| in_rows(row_of_slot[s]))
                .map(|s| weights[s] * values[row_of_slot[s] as usize * hidden + c])
                .sum();
            round_to(dtype, sum)
        })
        .collect();
    let drows: Vec<f64> = (0..rows * hidden)
        .map(|i| {
            let (r, c) = (i / hidden, i % hidden);
            let s = slot_of_row[r] as usize;
            if s < slots {
                round_to(dtype, weights[s] * dout[(s / top_k) * hidden + c])
            } else {
                0.0
            }
        })
        .collect();
    let dweights: Vec<f64> = (0..slots)
        .map(|s| {
            let r = row_of_slot[s];
            if !in_rows(r) {
                return 0.0;
            }
            let dot: f64 = (0..hidden)
                .map(|c| dout[(s / top_k) * hidden + c] * values[r as usize * hidden + c])
                .sum();
            round_to(dtype, dot)
        })
        .collect();

    let stride = hidden + pad;
    let problem = CombineProblem {
        tokens,
        top_k,
        rows,
        hidden,
        dtype,
        stride_multiple: gcd(hidden, stride),
    };
    let padded = |v: &[f64]| upload(client, dtype, &pad_rows(v, hidden, stride));
    let pitched = |handle| Rows { handle, stride };
    let rows_in = pitched(padded(&values));
    let dout_in = pitched(padded(&dout));
    let weights_in = upload(client, dtype, &weights);
    let row_of_slot_in = upload_i32(client, &row_of_slot);
    let read_rows = |rows_out: &Rows, n: usize| {
        unpad_rows(
            download(client, dtype, rows_out.handle.clone()),
            hidden,
            stride,
            &what,
        )[..n * hidden]
            .to_vec()
    };
    // Products and sums in f32, rounded once: within a rounding of the
    // f64 values.
    let tol = tolerance(dtype);

    let forward = CombineBuffers {
        rows: rows_in.clone(),
        weights: weights_in.clone(),
        row_of_slot: row_of_slot_in.clone(),
        out: pitched(poisoned(client, dtype, tokens * stride)),
    };
    combine::combine(client, &problem, &forward).unwrap();
    assert_close(
        &format!("combined {what}"),
        &read_rows(&forward.out, tokens),
        &out,
        tol,
        seed,
    );

    let rows_grad = CombineRowsGradBuffers {
        dout: dout_in.clone(),
        weights: weights_in.clone(),
        slot_of_row: upload_i32(client, &slot_of_row),
        drows: pitched(poisoned(client, dtype, rows * stride)),
    };
    combine::combine_rows_grad(client, &problem, &rows_grad).unwrap();
    let got = read_rows(&rows_grad.drows, rows);
    assert_close(&format!("rows' gradient {what}"), &got, &drows, tol, seed);
    assert!(
        got[(rows - padding) * hidden..].iter().all(|&v| v == 0.0),
        "a padding row's gradient is not zero: {what}"
    );

    let weights_grad = CombineWeightsGradBuffers {
        dout: dout_in,
        rows: rows_in,
        row_of_slot: row_of_slot_in,
        dweights: poisoned(client, dtype, slots),
    };
    combine::combine_weights_grad(client, &problem, &weights_grad).unwrap();
    let got = download(client, dtype, weights_grad.dweights.clone());
    assert_close_to_magnitude(&format!("weights' gradient {what}"), &got, &dweights, tol);

    // One weight too few, one row too few: refused before any launch.
    let short = CombineBuffers {
        weights: upload(client, dtype, &weights[..slots - 1]),
        ..forward.clone()
    };
    assert!(matches!(
        combine::combine(client, &problem, &short),
        Err(KernelError::Shape(e)) if e.contains("combine weights")
    ));
    let short = CombineRowsGradBuffers {
        slot_of_row: upload_i32(client, &slot_of_row[..rows - 1]),
        ..rows_grad
    };
    assert!(matches!(
        combine::combine_rows_grad(client, &problem, &short),
        Err(KernelError::Shape(e)) if e.contains("choice of each row")
    ));
}

struct Combine;

impl RuntimeTest for Combine {
    fn run<R: Runtime>(&self, device: &R::Device, _runtime: &str, dtypes: &[FloatDtype]) {
        let client = R::client(device);
        let mut rng = Rng::fresh();
        let cases: [Case; 4] = [
            [1, 1, 0, 1, 0],
            [13, 4, 5, 7, 3],
            [57, 2, 9, 64, 8],
            [300, 4, 40, 96, 0],
        ];
        for &dtype in &supported_dtypes(&client, dtypes) {
            for case in cases {
                check(&client, case, dtype, &mut rng);
            }
        }
    }
}

#[test]
fn combined_rows_and_gradients_match_reference() {
    for_each_runtime(&Combine);
}
