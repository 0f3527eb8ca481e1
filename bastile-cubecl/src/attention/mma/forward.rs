//! The tensor-core forward: one cube per (batch, query head, block of
//! `16·planes` query rows), one plane per 16 rows. The plane keeps its
//! queries, scores, probabilities and output accumulator in registers,
//! streams key/value blocks through shared memory, and runs the online
//! softmax on the accumulators themselves (the running maximum shared by
//! the four lanes of a row through shuffles, the running sum kept per lane
//! and combined once at the end).

use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use super::super::forward::query_block_keys;
use super::super::tile::{AttnTile, MASKED, MASKED_BELOW, allowed, cube_coords, key_count};
use super::fragment::{
    Frag, Pair, acc_to_a, copy_tile, half, load_a, load_b_cols, load_b_rows, load_tile, mma,
    quad_max, quad_sum, stage_accs, store_rows, zero_accs,
};
use super::{block_full, mma_units};

#[cube(launch_unchecked, fast_math = FastMath::all())]
#[allow(clippy::too_many_arguments)]
pub(crate) fn mma_forward_kernel<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    out: &mut Tensor<Vector<F, N>>,
    lse: &mut Tensor<f32>,
    sinks: &Tensor<f32>,
    key_lengths: &Tensor<i32>,
    strides: Sequence<usize>,
    batch: usize,
    heads: usize,
    group: usize,
    seq_q: usize,
    seq_k: usize,
    q_blocks: usize,
    window: usize,
    scale: f32,
    #[comptime] t: AttnTile,
    #[define(F)] _dtype: StorageType,
) {
    let rows = comptime![t.rows as usize];
    let cols = comptime![t.cols as usize];
    let vecs = comptime![t.head_dim as usize / 8];
    let pitch = comptime![t.head_dim as usize / 8 + 1];
    let units = comptime![mma_units(t)];
    let ksteps = comptime![t.head_dim as usize / 16];
    let sn = comptime![t.cols as usize / 8];
    let lane = UNIT_POS_PLANE as usize;
    let plane = UNIT_POS as usize / 32;
    let (b, h, qb) = cube_coords(q_blocks, heads, batch, true, t);
    if b < batch {
        let hk = h / group;
        let q0 = qb * rows;
        let klen = key_count(key_lengths, b, seq_k, t);
        let (offset, kb_first, kb_end) = query_block_keys(q0, seq_q, seq_k, klen, window, t);
        let q_last = select(q0 + rows < seq_q, q0 + rows, seq_q) - 1;

        let mut smem_q =
            SharedMemory::<Vector<F, N>>::new_aligned(comptime![rows * pitch], 16usize);
        // Two stages of K and V: the next block's copies fly while this
        // one is multiplied.
        let mut smem_k =
            SharedMemory::<Vector<F, N>>::new_aligned(comptime![2 * cols * pitch], 16usize);
        let mut smem_v =
            SharedMemory::<Vector<F, N>>::new_aligned(comptime![2 * cols * pitch], 16usize);
        let barrier = Barrier::shared(CUBE_DIM, UNIT_POS == 0);

        let q_base = b * strides[0usize] + h * strides[1usize];
        let k_base = b * strides[3usize] + hk * strides[4usize];
        let v_base = b * strides[6usize] + hk * strides[7usize];
        load_tile::<F, N>(
            q,
            q_base,
            strides[2usize],
            q0,
            seq_q,
            &mut smem_q,
            rows,
            vecs,
            units,
        );
        sync_cube();
        let row0 = plane * 16;
        let mut q_frags = Sequence::<Frag<F>>::new();
        #[unroll]
        for ks in 0..ksteps {
            q_frags.push(load_a::<F, N>(&smem_q, row0, ks * 16, pitch));
        }

        // This lane's rows: `top` and `top + 8` of the plane's 16.
        let top = q0 + row0 + lane / 4;
        let col = (lane % 4) * 2;
        let mut m_top = comptime![MASKED].runtime();
        let mut m_bot = comptime![MASKED].runtime();
        // Per-lane partial sums; the sink's term counts once per row.
        let mut l_top = 0.0f32;
        let mut l_bot = 0.0f32;
        if comptime![t.sinks] {
            m_top = sinks[h];
            m_bot = m_top;
            if col == 0 {
                l_top = 1.0f32;
                l_bot = 1.0f32;
            }
        }
        let mut o = zero_accs(vecs);

        if kb_first < kb_end {
            copy_block::<F, N>(
                k,
                v,
                k_base,
                v_base,
                &strides,
                kb_first * cols,
                seq_k,
                &mut smem_k,
                &mut smem_v,
                0usize,
                t,
            );
        }
        for kb in kb_first..kb_end {
            let k0 = kb * cols;
            barrier.commit_copy_async();
            barrier.arrive_and_wait();
            // Every unit is past the previous block: its stage is free.
            let stage = (kb - kb_first) % 2 * cols;
            if kb + 1 < kb_end {
                copy_block::<F, N>(
                    k,
                    v,
                    k_base,
                    v_base,
                    &strides,
                    k0 + cols,
                    seq_k,
                    &mut smem_k,
                    &mut smem_v,
                    cols - stage,
                    t,
                );
            }

            let mut s = zero_accs(sn);
            #[unroll]
            for ks in 0..ksteps {
                #[unroll]
                for np in 0..comptime![sn / 2] {
                    let pair = load_b_rows::<F, N>(&smem_k, stage + np * 16, ks * 16, pitch);
                    mma::<F>(
                        q_frags.index(ks),
                        &half::<F>(&pair, 0usize),
                        s.index_mut(2 * np),
                    );
                    mma::<F>(
                        q_frags.index(ks),
                        &half::<F>(&pair, 2usize),
                        s.index_mut(2 * np + 1),
                    );
                }
            }

            // Scale, mask where the block is not entirely visible, and take
            // the block's row maxima.
            let full = block_full(
                q0 + offset,
                q_last + offset,
                k0,
                k0 + cols - 1,
                klen,
                window,
                t,
            );
            let mut bm_top = comptime![MASKED].runtime();
            let mut bm_bot = comptime![MASKED].runtime();
            #[unroll]
            for nt in 0..sn {
                let acc = s.index_mut(nt);
                let mut x = acc[0usize] * Pair::<f32>::new(scale);
                let mut y = acc[1usize] * Pair::<f32>::new(scale);
                if !full {
                    let key = k0 + nt * 8 + col;
                    #[unroll]
                    for e in 0..2usize {
                        let ok_top = allowed(top + offset, key + e, klen, window, t);
                        let ok_bot = allowed(top + 8 + offset, key + e, klen, window, t);
                        x[e] = select(ok_top, x[e], MASKED);
                        y[e] = select(ok_bot, y[e], MASKED);
                    }
                }
                bm_top = f32::max(bm_top, f32::max(x[0usize], x[1usize]));
                bm_bot = f32::max(bm_bot, f32::max(y[0usize], y[1usize]));
                acc[0usize] = x;
                acc[1usize] = y;
            }
            let blk_top = quad_max(bm_top);
            let blk_bot = quad_max(bm_bot);
            // The plane keeps its running maxima (and skips rescaling the
            // output and sums) unless a row's block maximum passes its
            // own by more than RESCALE_SLACK: the probabilities then stay
            // below e^RESCALE_SLACK, and output, sum and lse all share the
            // stale reference, so the result is the same.
            let grows = blk_top > m_top + RESCALE_SLACK || blk_bot > m_bot + RESCALE_SLACK;
            if plane_any(grows) {
                let new_top = f32::max(m_top, blk_top);
                let new_bot = f32::max(m_bot, blk_bot);
                // A row that has seen only masked keys keeps a reference
                // of 0 (below), so its old terms scale by exp(MASKED) = 0.
                let alpha_top = f32::exp(m_top - reference(new_top));
                let alpha_bot = f32::exp(m_bot - reference(new_bot));
                m_top = new_top;
                m_bot = new_bot;
                l_top *= alpha_top;
                l_bot *= alpha_bot;
                #[unroll]
                for nt in 0..vecs {
                    let acc = o.index_mut(nt);
                    acc[0usize] = acc[0usize] * Pair::<f32>::new(alpha_top);
                    acc[1usize] = acc[1usize] * Pair::<f32>::new(alpha_bot);
                }
            }
            let use_top = reference(m_top);
            let use_bot = reference(m_bot);
            let mut sum_top = 0.0f32;
            let mut sum_bot = 0.0f32;
            #[unroll]
            for nt in 0..sn {
                let acc = s.index_mut(nt);
                let x = (acc[0usize] - Pair::<f32>::new(use_top)).exp();
                let y = (acc[1usize] - Pair::<f32>::new(use_bot)).exp();
                sum_top += x[0usize] + x[1usize];
                sum_bot += y[0usize] + y[1usize];
                acc[0usize] = x;
                acc[1usize] = y;
            }
            l_top += sum_top;
            l_bot += sum_bot;

            #[unroll]
            for kk in 0..comptime![sn / 2] {
                let p = acc_to_a::<F>(&s, kk);
                #[unroll]
                for dp in 0..comptime![vecs / 2] {
                    let pair = load_b_cols::<F, N>(&smem_v, stage + kk * 16, dp * 16, pitch);
                    mma::<F>(&p, &half::<F>(&pair, 0usize), o.index_mut(2 * dp));
                    mma::<F>(&p, &half::<F>(&pair, 2usize), o.index_mut(2 * dp + 1));
                }
            }
        }

        let l_top = quad_sum(l_top);
        let l_bot = quad_sum(l_bot);
        // A row that sees no key (and has no sink) outputs zeros, as
        // Burn's masked softmax does.
        let inv_top = select(l_top > 0.0f32, 1.0f32 / l_top, 0.0f32);
        let inv_bot = select(l_bot > 0.0f32, 1.0f32 / l_bot, 0.0f32);
        // The plane's own rows of the query tile hold its output now.
        stage_accs::<F, N>(
            &o,
            &mut smem_q,
            row0,
            0usize,
            inv_top,
            inv_bot,
            0usize,
            vecs,
            pitch,
        );
        sync_plane();
        store_rows::<F, N>(
            &smem_q,
            row0,
            out,
            b * strides[9usize] + h * strides[10usize],
            strides[11usize],
            q0 + row0,
            seq_q,
            vecs,
        );
        if col == 0 {
            let stat = (b * heads + h) * seq_q;
            if top < seq_q {
                lse[stat + top] = select(l_top > 0.0f32, m_top + f32::ln(l_top), MASKED);
            }
            if top + 8 < seq_q {
                lse[stat + top + 8] = select(l_bot > 0.0f32, m_bot + f32::ln(l_bot), MASKED);
            }
        }
    }
}

/// How far (in scaled-score units) a row's maximum may rise past the
/// plane's running reference before the reference moves: probabilities
/// stay below e^5.5 ≈ 245, well inside f16/bf16 and the f32 sums.
const RESCALE_SLACK: f32 = 5.5;

/// The value a row subtracts from its scores: its running maximum, or 0
/// while it has seen only masked keys, so that their entries give
/// exp(MASKED) = 0 rather than exp(0) = 1.
#[cube]
fn reference(m: f32) -> f32 {
    select(m > MASKED_BELOW, m, 0.0f32)
}

/// Starts the copies of keys and values `first .. first + cols` into rows
/// `row0 ..` of their staged tiles.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn copy_block<F: Float, N: Size>(
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    k_base: usize,
    v_base: usize,
    strides: &Sequence<usize>,
    first: usize,
    seq_k: usize,
    smem_k: &mut SharedMemory<Vector<F, N>>,
    smem_v: &mut SharedMemory<Vector<F, N>>,
    row0: usize,
    #[comptime] t: AttnTile,
) {
    let cols = comptime![t.cols as usize];
    let vecs = comptime![t.head_dim as usize / 8];
    let units = comptime![mma_units(t)];
    copy_tile::<F, N>(
        k,
        k_base,
        strides[5usize],
        first,
        seq_k,
        smem_k,
        row0,
        cols,
        vecs,
        units,
    );
    copy_tile::<F, N>(
        v,
        v_base,
        strides[8usize],
        first,
        seq_k,
        smem_v,
        row0,
        cols,
        vecs,
        units,
    );
}
