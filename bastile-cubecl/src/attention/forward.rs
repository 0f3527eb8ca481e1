//! The forward kernel: one cube per (batch, query head, block of query
//! rows), streaming key/value blocks with an online softmax. Saves only the
//! output and the per-row log-sum-exp.

use cubecl::prelude::*;

use crate::attention::{AttnDims, ForwardInputs};

use crate::reduce::{RowReduce, row_max, row_sum, row_sum_scratch};

use super::tile::{
    AttnTile, K, MASKED, MASKED_BELOW, OUT, Q, V, accumulate, allowed, first_key, head_rows,
    load_block, owned_rows, row_scores,
};

#[cube(launch_unchecked)]
pub(crate) fn attention_forward_kernel<F: Float>(
    inputs: &ForwardInputs<F>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
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
        let mut smem_kv = SharedMemory::<F>::new(comptime![t.cols as usize * t.pitch as usize]);
        let mut smem_p = SharedMemory::<f32>::new(comptime![(t.rows * t.cols) as usize]);
        let mut scratch = SharedMemory::<f32>::new(comptime![row_sum_scratch(
            RowReduce::Shared,
            t.upr,
            t.rows,
            1
        )]);

        let q_rows = head_rows(&inputs.strides, b, h, Q);
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

        let qi = own.first + row;
        let qpos = qi + own.offset;
        let lowest = first_key(&inputs.doc_starts, b, qpos, dims.seq_k, dims.window, t);
        // A sink is one more logit in the softmax with no value: start the
        // running max and sum from it.
        let mut m = comptime![MASKED].runtime();
        let mut l = 0.0f32;
        if comptime![t.sinks] {
            m = inputs.sinks[h];
            l = 1.0f32;
        }
        let mut acc = Array::<f32>::new(dc);
        #[unroll]
        for j in 0..dc {
            acc[j] = 0.0f32;
        }

        for kb in own.block_first..own.block_end {
            let k0 = kb * cols;
            sync_cube();
            load_block::<F>(&inputs.k, k_rows, k0, dims.seq_k, &mut smem_kv, t.cols, t);
            sync_cube();
            let mut s = row_scores::<F>(&smem_q, row, &smem_kv, lane, t);
            let mut block_max = comptime![MASKED].runtime();
            #[unroll]
            for j in 0..sc {
                let key = k0 + lane + j * upr;
                let ok = qi < dims.seq_q && allowed(qpos, key, lowest, own.klen, t);
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
            load_block::<F>(&inputs.v, v_rows, k0, dims.seq_k, &mut smem_kv, t.cols, t);
            sync_cube();
            accumulate::<F>(&mut acc, &smem_p, row, &smem_kv, lane, t);
        }

        if qi < dims.seq_q {
            // A row that sees no key (and has no sink) outputs zeros, as
            // Burn's masked softmax does.
            let inv = select(l > 0.0f32, 1.0f32 / l, 0.0f32);
            let o_rows = head_rows(&inputs.strides, b, h, OUT);
            let o_base = o_rows.base + qi * o_rows.stride;
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
