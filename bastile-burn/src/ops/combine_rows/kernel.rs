//! The combination's kernel launches on `CubeBackend`.

use burn::tensor::{Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;

use bastile_cubecl::combine::{
    self, CombineBuffers, CombineProblem, CombineRowsGradBuffers, CombineWeightsGradBuffers,
};

use super::{CombineRows, CombineRowsBackward};
use crate::fused::cube::{as_rows, contiguous_i32, empty_like, rows_cols, stride_multiple};
use crate::fused::{kernel, kernel_dtype, unpack};
use crate::launch_failure::launch;

/// The launch's shape: `rows` `[rows, hidden]`, `weights` `[tokens,
/// top_k]`, with `multiple` dividing every row stride.
fn problem<R: CubeRuntime>(
    rows: &CubeTensor<R>,
    weights: &CubeTensor<R>,
    multiple: usize,
) -> CombineProblem {
    let (row_count, hidden) = rows_cols(&rows.shape());
    CombineProblem {
        tokens: weights.shape()[0],
        top_k: weights.shape()[1],
        rows: row_count,
        hidden,
        dtype: kernel_dtype(rows.dtype).expect("validated dtype"),
        stride_multiple: multiple,
    }
}

kernel!(CombineRows, "bastile_combine_rows", |_, floats, ints| {
    let [rows, weights] = unpack(floats);
    let [row_of_slot] = unpack(ints);
    let (rows, rows_rows) = as_rows(rows);
    let weights = into_contiguous(weights);
    let row_of_slot = contiguous_i32(row_of_slot);
    let (tokens, hidden) = (weights.shape()[0], rows.shape()[1]);
    let (out, out_rows) = as_rows(empty_like(&rows, Shape::new([tokens, hidden]), rows.dtype));
    let problem = problem(
        &rows,
        &weights,
        stride_multiple(hidden, &[&rows_rows, &out_rows]),
    );
    let buffers = CombineBuffers {
        rows: rows_rows,
        weights: weights.handle.clone(),
        row_of_slot: row_of_slot.handle.clone(),
        out: out_rows,
    };
    launch("combined rows", || {
        combine::combine(&rows.client, &problem, &buffers)
    });
    vec![out]
});

kernel!(
    CombineRowsBackward,
    "bastile_combine_rows_backward",
    |op, floats, ints| {
        let [rows, weights, dout] = unpack(floats);
        let [row_of_slot, slot_of_row] = unpack(ints);
        let (rows, rows_rows) = as_rows(rows);
        // Held until the launches are queued: `dout_rows` is its buffer.
        let (_dout, dout_rows) = as_rows(dout);
        let weights = into_contiguous(weights);
        let hidden = rows.shape()[1];
        let mut grads = vec![];
        if op.rows_grad {
            let slot_of_row = contiguous_i32(slot_of_row);
            let (drows, drows_rows) = as_rows(empty_like(&rows, rows.shape(), rows.dtype));
            let multiple = stride_multiple(hidden, &[&dout_rows, &drows_rows]);
            let problem = problem(&rows, &weights, multiple);
            let buffers = CombineRowsGradBuffers {
                dout: dout_rows.clone(),
                weights: weights.handle.clone(),
                slot_of_row: slot_of_row.handle.clone(),
                drows: drows_rows,
            };
            launch("combined rows' gradient", || {
                combine::combine_rows_grad(&rows.client, &problem, &buffers)
            });
            grads.push(drows);
        }
        if op.weights_grad {
            let row_of_slot = contiguous_i32(row_of_slot);
            let dweights = empty_like(&weights, weights.shape(), weights.dtype);
            let multiple = stride_multiple(hidden, &[&dout_rows, &rows_rows]);
            let problem = problem(&rows, &weights, multiple);
            let buffers = CombineWeightsGradBuffers {
                dout: dout_rows,
                rows: rows_rows,
                row_of_slot: row_of_slot.handle.clone(),
                dweights: dweights.handle.clone(),
            };
            launch("combine weights' gradient", || {
                combine::combine_weights_grad(&rows.client, &problem, &buffers)
            });
            grads.push(dweights);
        }
        grads
    }
);
