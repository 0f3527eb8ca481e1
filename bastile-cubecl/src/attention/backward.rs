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

use crate::attention::AttnDims;

use super::forward::query_block_keys;
use super::tile::{AttnTile, accumulate, allowed, cube_coords, key_count, load_block, row_scores};
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
                let o = b * strides[9usize] + h * strides[10usize] + qi * strides[11usize];
                let g = b * strides[12usize] + h * strides[13usize] + qi * strides[14usize];
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

/// The query blocks `[first, end)` whose rows can see some key of
/// `[k_first, k_last]`: none before the keys when causal, none a whole
/// window past the last key.
#[cube]
pub(crate) fn query_block_range(
    k_first: usize,
    k_last: usize,
    seq_q: usize,
    offset: usize,
    window: usize,
    #[comptime] t: AttnTile,
) -> (usize, usize) {
    let cols = comptime![t.cols as usize];
    let mut start = 0usize;
    if comptime![t.causal] {
        start = select(k_first > offset, k_first - offset, 0usize);
    }
    let mut end = seq_q;
    if comptime![t.window] {
        let last_pos = k_last + window;
        let e = select(last_pos > offset, last_pos - offset, 0usize);
        end = select(e < end, e, end);
    }
    let first = start / cols;
    let last = end.div_ceil(cols);
    (first, select(last > first, last, first))
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_dkdv_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    dout: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    key_lengths: &Tensor<i32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    strides: Sequence<usize>,
    dims: AttnDims,
    #[comptime] t: AttnTile,
    #[define(F)] _dtype: StorageType,
) {
    let upr = comptime![t.upr as usize];
    let rows = comptime![t.rows as usize];
    let cols = comptime![t.cols as usize];
    let sc = comptime![(t.cols / t.upr) as usize];
    let dc = comptime![(t.head_dim / t.upr) as usize];
    let kv_heads = dims.heads / dims.group;
    // Cubes are `upr × rows` units: one row of the tile per Y.
    let row = UNIT_POS_Y as usize;
    let lane = UNIT_POS_X as usize;
    let (b, hk, kb) = cube_coords(dims.blocks, kv_heads, dims.batch, false, t);
    if b < dims.batch {
        let k0 = kb * rows;
        let klen = key_count(key_lengths, b, dims.seq_k, t);
        let offset = dims.seq_k - dims.seq_q;
        let key = k0 + row;
        let k_end = select(k0 + rows < dims.seq_k, k0 + rows, dims.seq_k);
        let (qb_first, qb_end) =
            query_block_range(k0, k_end - 1, dims.seq_q, offset, dims.window, t);

        let mut smem_k = SharedMemory::<F>::new(comptime![t.rows as usize * t.pitch as usize]);
        let mut smem_v = SharedMemory::<F>::new(comptime![t.rows as usize * t.pitch as usize]);
        let mut smem_q = SharedMemory::<F>::new(comptime![t.cols as usize * t.pitch as usize]);
        let mut smem_do = SharedMemory::<F>::new(comptime![t.cols as usize * t.pitch as usize]);
        let mut smem_p = SharedMemory::<f32>::new(comptime![(t.rows * t.cols) as usize]);
        let mut smem_ds = SharedMemory::<f32>::new(comptime![(t.rows * t.cols) as usize]);

        let k_base = b * strides[3usize] + hk * strides[4usize];
        let v_base = b * strides[6usize] + hk * strides[7usize];
        load_block::<F>(
            k,
            k_base,
            strides[5usize],
            k0,
            dims.seq_k,
            &mut smem_k,
            t.rows,
            t,
        );
        load_block::<F>(
            v,
            v_base,
            strides[8usize],
            k0,
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
            let q_base = b * strides[0usize] + h * strides[1usize];
            let do_base = b * strides[12usize] + h * strides[13usize];
            let stat_base = (b * dims.heads + h) * dims.seq_q;
            for qb in qb_first..qb_end {
                let q0 = qb * cols;
                sync_cube();
                load_block::<F>(
                    q,
                    q_base,
                    strides[2usize],
                    q0,
                    dims.seq_q,
                    &mut smem_q,
                    t.cols,
                    t,
                );
                load_block::<F>(
                    dout,
                    do_base,
                    strides[14usize],
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
                    let ok = qi < dims.seq_q && allowed(qi + offset, key, klen, dims.window, t);
                    let mut p = 0.0f32;
                    let mut ds = 0.0f32;
                    if ok {
                        p = f32::exp(s[j] * dims.scale - lse[stat_base + qi]);
                        ds = p * (dp[j] - delta[stat_base + qi]);
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
            let dk_base = b * strides[18usize] + hk * strides[19usize] + key * strides[20usize];
            let dv_base = b * strides[21usize] + hk * strides[22usize] + key * strides[23usize];
            #[unroll]
            for j in 0..dc {
                dk[dk_base + lane + j * upr] = F::cast_from(acc_k[j] * dims.scale);
                dv[dv_base + lane + j * upr] = F::cast_from(acc_v[j]);
            }
        }
    }
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_dq_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    dout: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    key_lengths: &Tensor<i32>,
    dq: &mut Tensor<F>,
    strides: Sequence<usize>,
    dims: AttnDims,
    #[comptime] t: AttnTile,
    #[define(F)] _dtype: StorageType,
) {
    let upr = comptime![t.upr as usize];
    let rows = comptime![t.rows as usize];
    let cols = comptime![t.cols as usize];
    let sc = comptime![(t.cols / t.upr) as usize];
    let dc = comptime![(t.head_dim / t.upr) as usize];
    // Cubes are `upr × rows` units: one row of the tile per Y.
    let row = UNIT_POS_Y as usize;
    let lane = UNIT_POS_X as usize;
    let (b, h, qb) = cube_coords(dims.blocks, dims.heads, dims.batch, true, t);
    if b < dims.batch {
        let hk = h / dims.group;
        let q0 = qb * rows;
        let klen = key_count(key_lengths, b, dims.seq_k, t);
        let (offset, kb_first, kb_end) =
            query_block_keys(q0, dims.seq_q, dims.seq_k, klen, dims.window, t);

        let mut smem_q = SharedMemory::<F>::new(comptime![t.rows as usize * t.pitch as usize]);
        let mut smem_do = SharedMemory::<F>::new(comptime![t.rows as usize * t.pitch as usize]);
        let mut smem_k = SharedMemory::<F>::new(comptime![t.cols as usize * t.pitch as usize]);
        let mut smem_v = SharedMemory::<F>::new(comptime![t.cols as usize * t.pitch as usize]);
        let mut smem_ds = SharedMemory::<f32>::new(comptime![(t.rows * t.cols) as usize]);

        let q_base = b * strides[0usize] + h * strides[1usize];
        let do_base = b * strides[12usize] + h * strides[13usize];
        let k_base = b * strides[3usize] + hk * strides[4usize];
        let v_base = b * strides[6usize] + hk * strides[7usize];
        load_block::<F>(
            q,
            q_base,
            strides[2usize],
            q0,
            dims.seq_q,
            &mut smem_q,
            t.rows,
            t,
        );
        load_block::<F>(
            dout,
            do_base,
            strides[14usize],
            q0,
            dims.seq_q,
            &mut smem_do,
            t.rows,
            t,
        );

        let qi = q0 + row;
        let mut row_lse = 0.0f32;
        let mut row_delta = 0.0f32;
        if qi < dims.seq_q {
            row_lse = lse[(b * dims.heads + h) * dims.seq_q + qi];
            row_delta = delta[(b * dims.heads + h) * dims.seq_q + qi];
        }
        let mut acc = Array::<f32>::new(dc);
        #[unroll]
        for j in 0..dc {
            acc[j] = 0.0f32;
        }

        for kb in kb_first..kb_end {
            let k0 = kb * cols;
            sync_cube();
            load_block::<F>(
                k,
                k_base,
                strides[5usize],
                k0,
                dims.seq_k,
                &mut smem_k,
                t.cols,
                t,
            );
            load_block::<F>(
                v,
                v_base,
                strides[8usize],
                k0,
                dims.seq_k,
                &mut smem_v,
                t.cols,
                t,
            );
            sync_cube();
            let s = row_scores::<F>(&smem_q, row, &smem_k, lane, t);
            let dp = row_scores::<F>(&smem_do, row, &smem_v, lane, t);
            #[unroll]
            for j in 0..sc {
                let c = lane + j * upr;
                let ok = qi < dims.seq_q && allowed(qi + offset, k0 + c, klen, dims.window, t);
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
            let dq_base = b * strides[15usize] + h * strides[16usize] + qi * strides[17usize];
            #[unroll]
            for j in 0..dc {
                dq[dq_base + lane + j * upr] = F::cast_from(acc[j] * dims.scale);
            }
        }
    }
}
