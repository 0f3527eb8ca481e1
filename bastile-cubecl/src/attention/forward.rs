//! The forward kernel: one cube per (batch, query head, block of query
//! rows), streaming key/value blocks with an online softmax. Saves only the
//! output and the per-row log-sum-exp.

use cubecl::prelude::*;

use crate::attention::AttnDims;

use crate::reduce::{RowReduce, row_max, row_sum, row_sum_scratch};

use super::tile::{
    AttnTile, MASKED, MASKED_BELOW, accumulate, allowed, cube_coords, key_count, load_block,
    row_scores,
};

/// The key blocks `[first, end)` a block of query positions
/// `[qpos_first, qpos_last]` can see: none past the last query when causal,
/// none a whole window behind the first query.
#[cube]
pub(crate) fn key_block_range(
    qpos_first: usize,
    qpos_last: usize,
    klen: usize,
    window: usize,
    #[comptime] t: AttnTile,
) -> (usize, usize) {
    let cols = comptime![t.cols as usize];
    let mut end = klen;
    if comptime![t.causal] {
        end = select(qpos_last + 1 < end, qpos_last + 1, end);
    }
    let mut start = 0usize;
    if comptime![t.window] {
        start = select(qpos_first + 1 > window, qpos_first + 1 - window, 0usize);
    }
    let first = start / cols;
    let last = end.div_ceil(cols);
    (first, select(last > first, last, first))
}

/// For the query block starting at row `q0`: the queries' offset into the
/// keys' frame (query `i` sits at key position `i + seq_k − seq_q`,
/// bottom-right aligned as Burn's causal mask; the launcher checks
/// `seq_k ≥ seq_q` when a mask uses it) and the key blocks its rows see.
#[cube]
pub(crate) fn query_block_keys(
    q0: usize,
    seq_q: usize,
    seq_k: usize,
    klen: usize,
    window: usize,
    #[comptime] t: AttnTile,
) -> (usize, usize, usize) {
    let rows = comptime![t.rows as usize];
    let offset = seq_k - seq_q;
    let q_end = select(q0 + rows < seq_q, q0 + rows, seq_q);
    let (first, end) = key_block_range(q0 + offset, q_end - 1 + offset, klen, window, t);
    (offset, first, end)
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_forward_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    sinks: &Tensor<f32>,
    key_lengths: &Tensor<i32>,
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
        let mut smem_kv = SharedMemory::<F>::new(comptime![t.cols as usize * t.pitch as usize]);
        let mut smem_p = SharedMemory::<f32>::new(comptime![(t.rows * t.cols) as usize]);
        let mut scratch = SharedMemory::<f32>::new(comptime![row_sum_scratch(
            RowReduce::Shared,
            t.upr,
            t.rows,
            1
        )]);

        let q_base = b * strides[0usize] + h * strides[1usize];
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

        let qi = q0 + row;
        let qpos = qi + offset;
        // A sink is one more logit in the softmax with no value: start the
        // running max and sum from it.
        let mut m = comptime![MASKED].runtime();
        let mut l = 0.0f32;
        if comptime![t.sinks] {
            m = sinks[h];
            l = 1.0f32;
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
                &mut smem_kv,
                t.cols,
                t,
            );
            sync_cube();
            let mut s = row_scores::<F>(&smem_q, row, &smem_kv, lane, t);
            let mut block_max = comptime![MASKED].runtime();
            #[unroll]
            for j in 0..sc {
                let ok =
                    qi < dims.seq_q && allowed(qpos, k0 + lane + j * upr, klen, dims.window, t);
                s[j] = select(ok, s[j] * dims.scale, MASKED);
                block_max = f32::max(block_max, s[j]);
            }
            let m_new = f32::max(
                m,
                row_max(block_max, &mut scratch, t.upr, t.upr, RowReduce::Shared),
            );
            let mut sum = 0.0f32;
            #[unroll]
            for j in 0..sc {
                let p = select(s[j] > MASKED_BELOW, f32::exp(s[j] - m_new), 0.0f32);
                smem_p[row * cols + lane + j * upr] = p;
                sum += p;
            }
            let alpha = f32::exp(m - m_new);
            l = l * alpha + row_sum(sum, &mut scratch, t.upr, t.upr, RowReduce::Shared);
            m = m_new;
            #[unroll]
            for j in 0..dc {
                acc[j] *= alpha;
            }
            // `row_sum` synchronized: every unit is done with K.
            load_block::<F>(
                v,
                v_base,
                strides[8usize],
                k0,
                dims.seq_k,
                &mut smem_kv,
                t.cols,
                t,
            );
            sync_cube();
            accumulate::<F>(&mut acc, &smem_p, row, &smem_kv, lane, t);
        }

        if qi < dims.seq_q {
            // A row that sees no key (and has no sink) outputs zeros, as
            // Burn's masked softmax does.
            let inv = select(l > 0.0f32, 1.0f32 / l, 0.0f32);
            let o_base = b * strides[9usize] + h * strides[10usize] + qi * strides[11usize];
            #[unroll]
            for j in 0..dc {
                out[o_base + lane + j * upr] = F::cast_from(acc[j] * inv);
            }
            if lane == 0 {
                lse[(b * dims.heads + h) * dims.seq_q + qi] =
                    select(l > 0.0f32, m + f32::ln(l), MASKED);
            }
        }
    }
}
