//! The backward kernels (flash-attention-2 style, recomputing the scores
//! block by block from the saved log-sum-exp):
//!
//! * `delta`: `Δᵢ = Σ_d dOᵢ·Oᵢ` per query row, and each row's share of the
//!   sink gradient, `−exp(sink − lseᵢ)·Δᵢ`;
//! * `dkdv`: one cube per (batch, kv head, key block) owns its dK and dV
//!   rows and streams every query block of every query head of its group
//!   past them, so GQA needs no atomics and no repeated K/V;
//! * `dq`: one cube per (batch, query head, query block) owns its dQ rows
//!   and streams the key blocks its rows can see.
//!
//! Strides come as one sequence: q, k, v, out, dout, dq, dk, dv, each as
//! (batch, head, row), the head dim always unit stride.

use cubecl::prelude::*;

use crate::attention::{AttnDims, BackwardInputs};

use super::tile::{
    AttnTile, DK, DOUT, DQ, DV, K, OUT, Q, V, accumulate, allowed, first_key, head_rows,
    load_block, owned_rows, query_end, row_scores, seen_by,
};
use crate::reduce::lane_sum;

/// `Δ = rowsum(o ⊙ dO)` (and each row's share of the sink gradient) for
/// `t.rows` consecutive query rows per cube. Neighbouring units read
/// neighbouring `N`-element vectors (of one row, then the next), so every
/// load of a plane is one contiguous run; each vector's product lands in
/// shared memory and one unit per row sums its row's.
///
/// With `zero_rows`, the cube also zeroes its rows of the dense f32
/// `[batch, heads, seq_q, d]` buffer `zeroed` (the tensor-core backward's
/// dQ accumulator), saving that buffer a launch of its own.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_delta_kernel<F: Float, N: Size>(
    out: &Tensor<Vector<F, N>>,
    dout: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    sinks: &Tensor<f32>,
    delta: &mut Tensor<f32>,
    dsink_rows: &mut Tensor<f32>,
    zeroed: &mut Tensor<Vector<f32, N>>,
    strides: Sequence<usize>,
    heads: usize,
    seq_q: usize,
    total_rows: usize,
    #[comptime] vecs: usize,
    #[comptime] zero_rows: bool,
    #[comptime] t: AttnTile,
    #[define(F)] _dtype: StorageType,
) {
    let rows = comptime![t.rows as usize];
    let units = comptime![(t.rows * t.upr) as usize];
    let items = comptime![rows * vecs];
    // One padded row of partial products per query row: the summing
    // units, `vecs + 1` apart, fall in different banks.
    let pitch = comptime![vecs + 1];
    let mut partial = SharedMemory::<f32>::new(comptime![rows * pitch]);
    let first = CUBE_POS * rows;
    if comptime![zero_rows] {
        // The cube's rows of `zeroed` are one contiguous run.
        let base = first * vecs + UNIT_POS as usize;
        #[unroll]
        for i in 0..comptime![items.div_ceil(units)] {
            let at = base + i * units;
            if at < total_rows * vecs {
                zeroed[at] = Vector::<f32, N>::new(0.0f32);
            }
        }
    }
    #[unroll]
    for it in 0..comptime![items.div_ceil(units)] {
        let i = it * units + UNIT_POS as usize;
        if i < items {
            let row = i / vecs;
            let c = i % vecs;
            let r = first + row;
            let mut product = 0.0f32;
            if r < total_rows {
                let qi = r % seq_q;
                let h = r / seq_q % heads;
                let b = r / seq_q / heads;
                let o_rows = head_rows(&strides, b, h, OUT);
                let do_rows = head_rows(&strides, b, h, DOUT);
                let o = o_rows.base + qi * o_rows.stride;
                let g = do_rows.base + qi * do_rows.stride;
                product = lane_sum(
                    Vector::<f32, N>::cast_from(out[o + c])
                        * Vector::<f32, N>::cast_from(dout[g + c]),
                );
            }
            partial[row * pitch + c] = product;
        }
    }
    sync_cube();
    let row = UNIT_POS as usize;
    let r = first + row;
    if row < rows && r < total_rows {
        let mut acc = 0.0f32;
        #[unroll]
        for c in 0..vecs {
            acc += partial[row * pitch + c];
        }
        delta[r] = acc;
        if comptime![t.sinks] {
            // The sink has no value: its score gradient is p_sink·(0 − Δ).
            let h = r / seq_q % heads;
            dsink_rows[r] = -f32::exp(sinks[h] - lse[r]) * acc;
        }
    }
}

#[cube(launch_unchecked)]
pub(crate) fn attention_dkdv_kernel<F: Float>(
    inputs: &BackwardInputs<F, f32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    dims: AttnDims,
    #[comptime] t: AttnTile,
    #[define(F)] _dtype: StorageType,
) {
    let upr = comptime![t.upr as usize];
    let cols = comptime![t.cols as usize];
    let sc = comptime![(t.cols / t.upr) as usize];
    let dc = comptime![(t.head_dim / t.upr) as usize];
    // Cubes are `upr × rows` units: one row of the tile per Y.
    let row = UNIT_POS_Y as usize;
    let lane = UNIT_POS_X as usize;
    let own = owned_rows(&dims, &inputs.key_lengths, &inputs.doc_starts, false, t);
    if own.b < dims.batch {
        let b = own.b;
        let hk = own.head;
        let key = own.first + row;
        let key_end = query_end(&inputs.doc_starts, b, key, dims.seq_k, dims.window, t);
        let mut smem_k = SharedMemory::<F>::new(comptime![t.rows as usize * t.pitch as usize]);
        let mut smem_v = SharedMemory::<F>::new(comptime![t.rows as usize * t.pitch as usize]);
        let mut smem_q = SharedMemory::<F>::new(comptime![t.cols as usize * t.pitch as usize]);
        let mut smem_do = SharedMemory::<F>::new(comptime![t.cols as usize * t.pitch as usize]);
        let mut smem_p = SharedMemory::<f32>::new(comptime![(t.rows * t.cols) as usize]);
        let mut smem_ds = SharedMemory::<f32>::new(comptime![(t.rows * t.cols) as usize]);

        let k_rows = head_rows(&inputs.strides, b, hk, K);
        let v_rows = head_rows(&inputs.strides, b, hk, V);
        load_block::<F>(
            &inputs.k,
            k_rows,
            own.first,
            dims.seq_k,
            &mut smem_k,
            t.rows,
            t,
        );
        load_block::<F>(
            &inputs.v,
            v_rows,
            own.first,
            dims.seq_k,
            &mut smem_v,
            t.rows,
            t,
        );

        let mut acc_k = Array::<f32>::new(dc);
        let mut acc_v = Array::<f32>::new(dc);
        #[unroll]
        for j in 0..dc {
            acc_k[j] = 0.0f32;
            acc_v[j] = 0.0f32;
        }

        for g in 0..dims.group {
            let h = hk * dims.group + g;
            let q_rows = head_rows(&inputs.strides, b, h, Q);
            let do_rows = head_rows(&inputs.strides, b, h, DOUT);
            let stat_base = (b * dims.heads + h) * dims.seq_q;
            for qb in own.block_first..own.block_end {
                let q0 = qb * cols;
                sync_cube();
                load_block::<F>(&inputs.q, q_rows, q0, dims.seq_q, &mut smem_q, t.cols, t);
                load_block::<F>(
                    &inputs.dout,
                    do_rows,
                    q0,
                    dims.seq_q,
                    &mut smem_do,
                    t.cols,
                    t,
                );
                sync_cube();
                let s = row_scores::<F>(&smem_k, row, &smem_q, lane, t);
                let dp = row_scores::<F>(&smem_v, row, &smem_do, lane, t);
                #[unroll]
                for j in 0..sc {
                    let c = lane + j * upr;
                    let qi = q0 + c;
                    let qpos = qi + own.offset;
                    let ok = qi < dims.seq_q && seen_by(qpos, key, key_end, own.klen, t);
                    let mut p = 0.0f32;
                    let mut ds = 0.0f32;
                    if ok {
                        p = f32::exp(s[j] * dims.scale - inputs.lse[stat_base + qi]);
                        ds = p * (dp[j] - inputs.delta[stat_base + qi]);
                    }
                    smem_p[row * cols + c] = p;
                    smem_ds[row * cols + c] = ds;
                }
                sync_cube();
                accumulate::<F>(&mut acc_v, &smem_p, row, &smem_do, lane, t);
                accumulate::<F>(&mut acc_k, &smem_ds, row, &smem_q, lane, t);
            }
        }

        if key < dims.seq_k {
            let dk_rows = head_rows(&inputs.strides, b, hk, DK);
            let dv_rows = head_rows(&inputs.strides, b, hk, DV);
            let dk_base = dk_rows.base + key * dk_rows.stride;
            let dv_base = dv_rows.base + key * dv_rows.stride;
            #[unroll]
            for j in 0..dc {
                dk[dk_base + lane + j * upr] = F::cast_from(acc_k[j] * dims.scale);
                dv[dv_base + lane + j * upr] = F::cast_from(acc_v[j]);
            }
        }
    }
}

#[cube(launch_unchecked)]
pub(crate) fn attention_dq_kernel<F: Float>(
    inputs: &BackwardInputs<F, f32>,
    dq: &mut Tensor<F>,
    dims: AttnDims,
    #[comptime] t: AttnTile,
    #[define(F)] _dtype: StorageType,
) {
    let upr = comptime![t.upr as usize];
    let cols = comptime![t.cols as usize];
    let sc = comptime![(t.cols / t.upr) as usize];
    let dc = comptime![(t.head_dim / t.upr) as usize];
    // Cubes are `upr × rows` units: one row of the tile per Y.
    let row = UNIT_POS_Y as usize;
    let lane = UNIT_POS_X as usize;
    let own = owned_rows(&dims, &inputs.key_lengths, &inputs.doc_starts, true, t);
    if own.b < dims.batch {
        let b = own.b;
        let h = own.head;
        let mut smem_q = SharedMemory::<F>::new(comptime![t.rows as usize * t.pitch as usize]);
        let mut smem_do = SharedMemory::<F>::new(comptime![t.rows as usize * t.pitch as usize]);
        let mut smem_k = SharedMemory::<F>::new(comptime![t.cols as usize * t.pitch as usize]);
        let mut smem_v = SharedMemory::<F>::new(comptime![t.cols as usize * t.pitch as usize]);
        let mut smem_ds = SharedMemory::<f32>::new(comptime![(t.rows * t.cols) as usize]);

        let q_rows = head_rows(&inputs.strides, b, h, Q);
        let do_rows = head_rows(&inputs.strides, b, h, DOUT);
        let hk = h / dims.group;
        let k_rows = head_rows(&inputs.strides, b, hk, K);
        let v_rows = head_rows(&inputs.strides, b, hk, V);
        load_block::<F>(
            &inputs.q,
            q_rows,
            own.first,
            dims.seq_q,
            &mut smem_q,
            t.rows,
            t,
        );
        load_block::<F>(
            &inputs.dout,
            do_rows,
            own.first,
            dims.seq_q,
            &mut smem_do,
            t.rows,
            t,
        );

        let qi = own.first + row;
        let qpos = qi + own.offset;
        let lowest = first_key(&inputs.doc_starts, b, qpos, dims.seq_k, dims.window, t);
        let mut row_lse = 0.0f32;
        let mut row_delta = 0.0f32;
        if qi < dims.seq_q {
            row_lse = inputs.lse[(b * dims.heads + h) * dims.seq_q + qi];
            row_delta = inputs.delta[(b * dims.heads + h) * dims.seq_q + qi];
        }
        let mut acc = Array::<f32>::new(dc);
        #[unroll]
        for j in 0..dc {
            acc[j] = 0.0f32;
        }

        for kb in own.block_first..own.block_end {
            let k0 = kb * cols;
            sync_cube();
            load_block::<F>(&inputs.k, k_rows, k0, dims.seq_k, &mut smem_k, t.cols, t);
            load_block::<F>(&inputs.v, v_rows, k0, dims.seq_k, &mut smem_v, t.cols, t);
            sync_cube();
            let s = row_scores::<F>(&smem_q, row, &smem_k, lane, t);
            let dp = row_scores::<F>(&smem_do, row, &smem_v, lane, t);
            #[unroll]
            for j in 0..sc {
                let c = lane + j * upr;
                let ok = qi < dims.seq_q && allowed(qpos, k0 + c, lowest, own.klen, t);
                let mut ds = 0.0f32;
                if ok {
                    ds = f32::exp(s[j] * dims.scale - row_lse) * (dp[j] - row_delta);
                }
                smem_ds[row * cols + c] = ds;
            }
            sync_cube();
            accumulate::<F>(&mut acc, &smem_ds, row, &smem_k, lane, t);
        }

        if qi < dims.seq_q {
            let dq_rows = head_rows(&inputs.strides, b, h, DQ);
            let dq_base = dq_rows.base + qi * dq_rows.stride;
            #[unroll]
            for j in 0..dc {
                dq[dq_base + lane + j * upr] = F::cast_from(acc[j] * dims.scale);
            }
        }
    }
}
