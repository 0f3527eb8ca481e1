//! The tensor-core forward: one cube per (batch, query head, block of
//! `16·tiles·planes` query rows), one plane per `16·tiles` rows. The plane
//! keeps its scores, probabilities and output accumulators (and, with one
//! tile, its queries) in registers, streams key/value blocks through
//! shared memory, and runs the online softmax on the accumulators
//! themselves (the running maximum shared by the four lanes of a row
//! through shuffles, the running sum kept per lane and combined once at
//! the end).

use cubecl::prelude::*;

use crate::attention::{AttnDims, ForwardInputs};

use super::super::tile::{
    AttnTile, K, MASKED, MASKED_BELOW, OUT, OwnedRows, Q, V, allowed, first_key, head_rows,
    owned_rows,
};
use super::fragment::{
    Frag, Pair, Tile, a_base, acc_to_a, cols_base, load_a, load_b_cols, load_b_rows, load_tile,
    mma_pair, products, quad_max, quad_sum, rows_base, stage_accs, store_rows, zero_accs,
};
use super::stream::KeyStream;
use super::{keys_full, mma_units, plane_tiles};

#[cube(launch_unchecked, fast_math = FastMath::all())]
pub(crate) fn mma_forward_kernel<F: Float, N: Size>(
    inputs: &ForwardInputs<Vector<F, N>>,
    out: &mut Tensor<Vector<F, N>>,
    lse: &mut Tensor<f32>,
    dims: AttnDims,
    #[comptime] t: AttnTile,
    #[define(F)] _dtype: StorageType,
) {
    // 32-lane planes: the launcher runs these kernels only there.
    let lane = UNIT_POS_PLANE as usize;
    let plane = UNIT_POS as usize / 32;
    let rows = comptime![t.rows as usize];
    let cols = comptime![t.cols as usize];
    let vecs = comptime![t.head_dim as usize / 8];
    let pitch = comptime![t.head_dim as usize / 8 + 1];
    let units = comptime![mma_units(t)];
    let ksteps = comptime![t.head_dim as usize / 16];
    let sn = comptime![t.cols as usize / 8];
    let mt = comptime![plane_tiles(t)];
    // Rows of the plane each lane holds statistics for: two per tile.
    let rl = comptime![2 * mt];
    let own = owned_rows(&dims, &inputs.key_lengths, &inputs.doc_starts, true, t);
    if own.b < dims.batch {
        let b = own.b;
        let h = own.head;
        let q0 = own.first;
        let mut smem_q =
            SharedMemory::<Vector<F, N>>::new_aligned(comptime![rows * pitch], 16usize);

        let q_rows = head_rows(&inputs.strides, b, h, Q);
        let hk = h / dims.group;
        let k_rows = head_rows(&inputs.strides, b, hk, K);
        let v_rows = head_rows(&inputs.strides, b, hk, V);
        load_tile::<F, N>(
            &inputs.q,
            q_rows,
            q0,
            dims.seq_q,
            &mut smem_q,
            rows,
            vecs,
            units,
        );
        sync_cube();
        let row0 = plane * comptime![16 * mt];
        // Single-tile planes keep their query fragments in registers for
        // every key block; two-tile planes read them from the tile each
        // block (their registers hold twice the scores and outputs).
        let mut q_frags = Sequence::<Frag<F>>::new();
        if comptime![mt == 1] {
            let at_q = a_base(row0, 0usize, pitch);
            #[unroll]
            for ks in 0..ksteps {
                q_frags.push(load_a::<F, N>(&smem_q, at_q, 0usize, ks * 16, pitch));
            }
        }

        // This lane's rows: `top + 16·m` and `top + 16·m + 8` of tile `m`
        // of the plane, kept in the row statistics at `2·m` and `2·m + 1`.
        let top = q0 + row0 + lane / 4;
        let col = (lane % 4) * 2;
        // The first key each of the lane's rows sees (window, document).
        let mut lowest = Array::<usize>::new(rl);
        #[unroll]
        for r in 0..rl {
            let qpos = top + (r / 2) * 16 + (r % 2) * 8 + own.offset;
            lowest[r] = first_key(&inputs.doc_starts, b, qpos, dims.seq_k, dims.window, t);
        }
        let mut m_run = Array::<f32>::new(rl);
        // Per-lane partial sums; the sink's term counts once per row.
        let mut l_run = Array::<f32>::new(rl);
        #[unroll]
        for r in 0..rl {
            m_run[r] = MASKED;
            l_run[r] = 0.0f32;
            if comptime![t.sinks] {
                m_run[r] = inputs.sinks[h];
                l_run[r] = select(col == 0, 1.0f32, 0.0f32);
            }
        }
        let mut o = zero_accs(comptime![mt * vecs]);

        let first = own.block_first;
        let end = own.block_end;
        let mut keys = KeyStream::<F, N>::start(
            &inputs.k, &inputs.v, k_rows, v_rows, dims.seq_k, first, end, t,
        );
        for kb in own.block_first..own.block_end {
            let k0 = kb * cols;
            let stage = keys.wait(&inputs.k, &inputs.v, kb, t);
            let mut s = block_scores::<F, N>(&smem_q, row0, &q_frags, &keys.k, stage, mt, t);

            // Scale, mask where the block is not entirely visible, and take
            // the block's row maxima.
            let full = keys_full(&own, k0, t);
            let mut blk = Array::<f32>::new(rl);
            #[unroll]
            for r in 0..rl {
                blk[r] = MASKED;
            }
            // One test per block: a block seen whole runs no per-element
            // check.
            let row_top = top + own.offset;
            if full {
                scale_scores(
                    &mut s, &mut blk, k0, row_top, &lowest, &own, &dims, false, mt, t,
                );
            } else {
                scale_scores(
                    &mut s, &mut blk, k0, row_top, &lowest, &own, &dims, true, mt, t,
                );
            }
            // The plane keeps its running maxima (and skips rescaling the
            // output and sums) unless a row's block maximum passes its
            // own by more than RESCALE_SLACK: the probabilities then stay
            // below e^RESCALE_SLACK, and output, sum and lse all share the
            // stale reference, so the result is the same.
            let mut grows = false;
            #[unroll]
            for r in 0..rl {
                blk[r] = quad_max(blk[r]);
                grows = grows || blk[r] > m_run[r] + RESCALE_SLACK;
            }
            if plane_any(grows) {
                #[unroll]
                for m in 0..mt {
                    let mut alpha = Array::<f32>::new(2usize);
                    #[unroll]
                    for hr in 0..2usize {
                        let r = 2 * m + hr;
                        let new = f32::max(m_run[r], blk[r]);
                        // A row that has seen only masked keys keeps a
                        // reference of 0 (below), so its old terms scale
                        // by exp(MASKED) = 0.
                        alpha[hr] = f32::exp(m_run[r] - reference(new));
                        m_run[r] = new;
                        l_run[r] = l_run[r] * alpha[hr];
                    }
                    #[unroll]
                    for nt in 0..vecs {
                        let acc = o.index_mut(m * vecs + nt);
                        acc[0usize] = acc[0usize] * Pair::<f32>::new(alpha[0usize]);
                        acc[1usize] = acc[1usize] * Pair::<f32>::new(alpha[1usize]);
                    }
                }
            }
            #[unroll]
            for m in 0..mt {
                #[unroll]
                for hr in 0..2usize {
                    let r = 2 * m + hr;
                    let use_m = reference(m_run[r]);
                    let mut sum = 0.0f32;
                    #[unroll]
                    for nt in 0..sn {
                        let acc = s.index_mut(m * sn + nt);
                        let x = (acc[hr] - Pair::<f32>::new(use_m)).exp();
                        sum += x[0usize] + x[1usize];
                        acc[hr] = x;
                    }
                    l_run[r] = l_run[r] + sum;
                }
            }

            let at_v = cols_base(stage, 0usize, pitch);
            #[unroll]
            for kk in 0..comptime![sn / 2] {
                let mut p = Sequence::<Frag<F>>::new();
                #[unroll]
                for m in 0..mt {
                    p.push(acc_to_a::<F>(&s, comptime![m * sn / 2 + kk]));
                }
                #[unroll]
                for dp in 0..comptime![vecs / 2] {
                    let pair = load_b_cols::<F, N>(&keys.v, at_v, kk * 16, dp * 16, pitch);
                    #[unroll]
                    for m in 0..mt {
                        mma_pair::<F>(p.index(m), &pair, &mut o, comptime![m * vecs + 2 * dp]);
                    }
                }
            }
        }

        // The plane's own rows of the query tile hold its output now.
        let mut inv = Array::<f32>::new(rl);
        #[unroll]
        for r in 0..rl {
            let l = quad_sum(l_run[r]);
            l_run[r] = l;
            // A row that sees no key (and has no sink) outputs zeros, as
            // Burn's masked softmax does.
            inv[r] = select(l > 0.0f32, 1.0f32 / l, 0.0f32);
        }
        #[unroll]
        for m in 0..mt {
            stage_accs::<F, N>(
                &o,
                &mut smem_q,
                row0 + m * 16,
                0usize,
                inv[2 * m],
                inv[2 * m + 1],
                comptime![m * vecs],
                vecs,
                pitch,
            );
        }
        sync_plane();
        let out_rows = head_rows(&inputs.strides, b, h, OUT);
        #[unroll]
        for m in 0..mt {
            let tile_row = row0 + m * 16;
            let row = q0 + row0 + m * 16;
            store_rows::<F, N>(&smem_q, tile_row, out, out_rows, row, dims.seq_q, vecs);
        }
        if col == 0 {
            let stat = (b * dims.heads + h) * dims.seq_q;
            #[unroll]
            for r in 0..rl {
                let row = top + (r / 2) * 16 + (r % 2) * 8;
                let l = l_run[r];
                if row < dims.seq_q {
                    lse[stat + row] = select(l > 0.0f32, m_run[r] + f32::ln(l), MASKED);
                }
            }
        }
    }
}

/// Scales a block's scores (keys from `k0`; the lane's first row at
/// `row_top` in key positions) in place and takes their row maxima into
/// `blk`; with `masked`, scores of keys the row may not see (before its
/// `lowest` key, at `2·m + hr` for tile `m`'s half `hr`) become `MASKED`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn scale_scores(
    s: &mut Sequence<Frag<f32>>,
    blk: &mut Array<f32>,
    k0: usize,
    row_top: usize,
    lowest: &Array<usize>,
    own: &OwnedRows,
    dims: &AttnDims,
    #[comptime] masked: bool,
    #[comptime] mt: usize,
    #[comptime] t: AttnTile,
) {
    let sn = comptime![t.cols as usize / 8];
    let col = (UNIT_POS_PLANE as usize % 4) * 2;
    #[unroll]
    for m in 0..mt {
        #[unroll]
        for nt in 0..sn {
            let acc = s.index_mut(m * sn + nt);
            #[unroll]
            for hr in 0..2usize {
                let mut x = acc[hr] * Pair::<f32>::new(dims.scale);
                if comptime![masked] {
                    let key = k0 + nt * 8 + col;
                    let row = row_top + m * 16 + hr * 8;
                    #[unroll]
                    for e in 0..2usize {
                        let ok = allowed(row, key + e, lowest[2 * m + hr], own.klen, t);
                        x[e] = select(ok, x[e], MASKED);
                    }
                }
                let r = 2 * m + hr;
                blk[r] = f32::max(blk[r], f32::max(x[0usize], x[1usize]));
                acc[hr] = x;
            }
        }
    }
}

/// The scores of one key block, `mt·sn` accumulators (tile `m` of the
/// plane at `m·sn`): single-tile planes multiply their register query
/// fragments, two-tile planes read theirs from the query tile.
#[cube]
#[allow(clippy::too_many_arguments)]
fn block_scores<F: Float, N: Size>(
    smem_q: &Tile<F, N>,
    row0: usize,
    q_frags: &Sequence<Frag<F>>,
    smem_k: &Tile<F, N>,
    stage: usize,
    #[comptime] mt: usize,
    #[comptime] t: AttnTile,
) -> Sequence<Frag<f32>> {
    let pitch = comptime![t.head_dim as usize / 8 + 1];
    let sn = comptime![t.cols as usize / 8];
    let ksteps = comptime![t.head_dim as usize / 16];
    if comptime![mt == 1] {
        let mut s = zero_accs(sn);
        let at_k = rows_base(stage, 0usize, pitch);
        #[unroll]
        for ks in 0..ksteps {
            #[unroll]
            for np in 0..comptime![sn / 2] {
                let pair = load_b_rows::<F, N>(smem_k, at_k, np * 16, ks * 16, pitch);
                mma_pair::<F>(q_frags.index(ks), &pair, &mut s, comptime![2 * np]);
            }
        }
        s
    } else {
        products::<F, N>(smem_q, row0, smem_k, stage, mt, sn, ksteps, pitch)
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
