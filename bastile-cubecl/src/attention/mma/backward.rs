//! The tensor-core backward, flash-attention-2 style, in its separate
//! form (the fused one, which the tuner weighs against it, is in
//! `fused_backward`):
//!
//! * `dkdv`: one cube per (batch, kv head, block of `16·planes` keys), one
//!   plane per 16 keys. For every query head of the group and every query
//!   block that sees its keys (streamed through two stages of shared
//!   memory by asynchronous copies) it forms `Sᵀ = K·Qᵀ` and `dPᵀ = V·dOᵀ`
//!   in registers, then `Pᵀ = exp(scale·Sᵀ − lse)` and
//!   `dSᵀ = Pᵀ ⊙ (dPᵀ − Δ)`, and accumulates `dV += Pᵀ·dO`,
//!   `dK += dSᵀ·Q` with the probabilities as the A operand.
//! * `dq`: one cube per (batch, query head, block of `16·planes` queries)
//!   forms `S`, `dP`, `dS` again for each key block its rows see and
//!   accumulates `dQ += dS·K`: seven products per block pair in all,
//!   every output owned by one cube, so the result is deterministic.
//!
//! `Δ` and the sink gradient come from the tiled path's row kernel.

use cubecl::prelude::*;

use crate::attention::{AttnDims, BackwardInputs};

use super::super::tile::{
    AttnTile, DK, DOUT, DQ, DV, K, OwnedRows, Q, V, allowed, first_key, head_rows, owned_rows,
    query_end, seen_by,
};
use super::fragment::{
    Frag, Pair, Tile, acc_to_a, cols_base, load_b_cols, load_tile, mma_pair, products, stage_accs,
    store_rows, zero_accs,
};
use super::stream::{KeyStream, QueryStream};
use super::{keys_full, mma_units, queries_full};

/// `lse` of a query row that does not exist: its probabilities are
/// exp(−huge) = 0.
pub(crate) const NO_ROW: f32 = 3.0e38;

/// One f32 of the per-row statistics, typed as a one-element vector so a
/// staged block of them can be read in pairs.
pub(crate) type Stat = Vector<f32, Const<1>>;

/// What the key-owning kernels (dK/dV and fused) read: statistics staged
/// by asynchronous copies, so typed as [`Stat`].
pub(crate) type KeySideInputs<F, N> = BackwardInputs<Vector<F, N>, Stat>;

/// `acc[n] += A · tile` over `n` accumulators of 8 head-dim columns: `A`
/// is the probabilities or score gradients (accumulators `2kk`, `2kk + 1`
/// of `weights`), the tile (from row `first`) row-major with the reduction
/// over its rows.
#[cube]
fn accumulate_rows<F: Float, N: Size>(
    acc: &mut Sequence<Frag<f32>>,
    weights: &Sequence<Frag<f32>>,
    tile: &Tile<F, N>,
    first: usize,
    #[comptime] sn: usize,
    #[comptime] vecs: usize,
    #[comptime] pitch: usize,
) {
    let at = cols_base(first, 0usize, pitch);
    #[unroll]
    for kk in 0..comptime![sn / 2] {
        let a = acc_to_a::<F>(weights, kk);
        #[unroll]
        for dp in 0..comptime![vecs / 2] {
            let pair = load_b_cols::<F, N>(tile, at, kk * 16, dp * 16, pitch);
            mma_pair::<F>(&a, &pair, acc, comptime![2 * dp]);
        }
    }
}

/// Loads the cube's keys and values (zeros past the sequence) into their
/// tiles.
#[cube]
pub(crate) fn load_keys_values<F: Float, N: Size>(
    inputs: &KeySideInputs<F, N>,
    own: &OwnedRows,
    seq_k: usize,
    smem_k: &mut Tile<F, N>,
    smem_v: &mut Tile<F, N>,
    #[comptime] t: AttnTile,
) {
    let rows = comptime![t.rows as usize];
    let vecs = comptime![t.head_dim as usize / 8];
    let units = comptime![mma_units(t)];
    let k_rows = head_rows(&inputs.strides, own.b, own.head, K);
    let v_rows = head_rows(&inputs.strides, own.b, own.head, V);
    load_tile::<F, N>(
        &inputs.k, k_rows, own.first, seq_k, smem_k, rows, vecs, units,
    );
    load_tile::<F, N>(
        &inputs.v, v_rows, own.first, seq_k, smem_v, rows, vecs, units,
    );
}

/// Writes the plane's 16 rows (from `row0`) of the staged dK and dV tiles
/// to the cube's rows of its kv head, skipping rows past the sequence.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn store_dk_dv<F: Float, N: Size>(
    smem_k: &Tile<F, N>,
    smem_v: &Tile<F, N>,
    dk: &mut Tensor<Vector<F, N>>,
    dv: &mut Tensor<Vector<F, N>>,
    inputs: &KeySideInputs<F, N>,
    own: &OwnedRows,
    row0: usize,
    seq_k: usize,
    #[comptime] t: AttnTile,
) {
    let vecs = comptime![t.head_dim as usize / 8];
    let dk_rows = head_rows(&inputs.strides, own.b, own.head, DK);
    let dv_rows = head_rows(&inputs.strides, own.b, own.head, DV);
    let first = own.first + row0;
    store_rows::<F, N>(smem_k, row0, dk, dk_rows, first, seq_k, vecs);
    store_rows::<F, N>(smem_v, row0, dv, dv_rows, first, seq_k, vecs);
}

/// Turns a plane's `Sᵀ` and `dPᵀ` accumulators (`mt` tiles of 16 keys,
/// the lane's first row `key_top`, by `8·sn` queries from column `qoff` of
/// the block of queries from `q0`) into `Pᵀ = exp(scale·Sᵀ − lse)` and
/// `dSᵀ = Pᵀ ⊙ (dPᵀ − Δ)`, zero where the query may not see the key
/// (checked only when the block is not `full`, against the lane's keys'
/// `key_ends` from [`lane_key_ends`]). The block's statistics
/// are staged from row `first` of `stats`' stage: `lse` then `Δ`, read as
/// the lane's pairs of columns.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn softmax_grads(
    p: &mut Sequence<Frag<f32>>,
    ds: &mut Sequence<Frag<f32>>,
    stats: &SharedMemory<Stat>,
    first: usize,
    qoff: usize,
    q0: usize,
    key_top: usize,
    key_ends: &Array<usize>,
    full: bool,
    own: &OwnedRows,
    dims: &AttnDims,
    #[comptime] mt: usize,
    #[comptime] sn: usize,
    #[comptime] t: AttnTile,
) {
    let q_pos = q0 + own.offset;
    let klen = own.klen;
    let scale = dims.scale;
    // One test per block: a block seen whole runs no per-element check.
    if full {
        block_grads(
            p, ds, stats, first, qoff, q_pos, key_top, key_ends, klen, scale, false, mt, sn, t,
        );
    } else {
        block_grads(
            p, ds, stats, first, qoff, q_pos, key_top, key_ends, klen, scale, true, mt, sn, t,
        );
    }
}

/// The [`query_end`] of each of the lane's keys (`key_top + 16·m + 8·r`
/// at `2·m + r`, for the `mt` 16-key tiles of its plane).
#[cube]
pub(crate) fn lane_key_ends<F: Float, N: Size>(
    inputs: &KeySideInputs<F, N>,
    own: &OwnedRows,
    dims: &AttnDims,
    key_top: usize,
    #[comptime] mt: usize,
    #[comptime] t: AttnTile,
) -> Array<usize> {
    let mut ends = Array::<usize>::new(comptime![2 * mt]);
    #[unroll]
    for i in 0..comptime![2 * mt] {
        let key = key_top + (i / 2) * 16 + (i % 2) * 8;
        ends[i] = query_end(&inputs.doc_starts, own.b, key, dims.seq_k, dims.window, t);
    }
    ends
}

/// [`softmax_grads`] for one branch of the block's `full` test: with
/// `masked`, every element is checked.
#[cube]
#[allow(clippy::too_many_arguments)]
fn block_grads(
    p: &mut Sequence<Frag<f32>>,
    ds: &mut Sequence<Frag<f32>>,
    smem_stat: &SharedMemory<Stat>,
    first: usize,
    qoff: usize,
    q_pos: usize,
    key_top: usize,
    key_ends: &Array<usize>,
    klen: usize,
    scale: f32,
    #[comptime] masked: bool,
    #[comptime] mt: usize,
    #[comptime] sn: usize,
    #[comptime] t: AttnTile,
) {
    let cols = comptime![t.cols as usize];
    let col = (UNIT_POS_PLANE as usize % 4) * 2;
    let stats = smem_stat.to_slice().with_vector_size::<Const<2>>();
    #[unroll]
    for nt in 0..sn {
        let at = (2 * first + qoff + nt * 8 + col) / 2;
        let neg_lse = Pair::<f32>::new(0.0f32) - stats[at];
        let dlt = stats[at + cols / 2];
        #[unroll]
        for m in 0..mt {
            let s_acc = p.index_mut(m * sn + nt);
            let d_acc = ds.index_mut(m * sn + nt);
            #[unroll]
            for r in 0..2usize {
                let mut x = fma(s_acc[r], Pair::<f32>::new(scale), neg_lse).exp();
                if comptime![masked] {
                    #[unroll]
                    for e in 0..2usize {
                        let c = qoff + nt * 8 + col + e;
                        let key = key_top + m * 16 + r * 8;
                        let ok = seen_by(q_pos + c, key, key_ends[2 * m + r], klen, t);
                        x[e] = select(ok, x[e], 0.0f32);
                    }
                }
                d_acc[r] = x * (d_acc[r] - dlt);
                s_acc[r] = x;
            }
        }
    }
}

#[cube(launch_unchecked, fast_math = FastMath::all())]
pub(crate) fn mma_dkdv_kernel<F: Float, N: Size>(
    inputs: &KeySideInputs<F, N>,
    dk: &mut Tensor<Vector<F, N>>,
    dv: &mut Tensor<Vector<F, N>>,
    dims: AttnDims,
    #[comptime] t: AttnTile,
    #[define(F)] _dtype: StorageType,
) {
    // 32-lane planes: the launcher runs these kernels only there.
    let lane = UNIT_POS_PLANE as usize;
    let plane = UNIT_POS as usize / 32;
    let rows = comptime![t.rows as usize];
    let vecs = comptime![t.head_dim as usize / 8];
    let pitch = comptime![t.head_dim as usize / 8 + 1];
    let ksteps = comptime![t.head_dim as usize / 16];
    let sn = comptime![t.cols as usize / 8];
    let own = owned_rows(&dims, &inputs.key_lengths, &inputs.doc_starts, false, t);
    if own.b < dims.batch {
        let mut smem_k =
            SharedMemory::<Vector<F, N>>::new_aligned(comptime![rows * pitch], 16usize);
        let mut smem_v =
            SharedMemory::<Vector<F, N>>::new_aligned(comptime![rows * pitch], 16usize);
        load_keys_values::<F, N>(inputs, &own, dims.seq_k, &mut smem_k, &mut smem_v, t);

        let row0 = plane * 16;
        let key_top = own.first + row0 + lane / 4;
        let key_ends = lane_key_ends::<F, N>(inputs, &own, &dims, key_top, 1usize, t);
        let mut acc_k = zero_accs(vecs);
        let mut acc_v = zero_accs(vecs);

        // Every (query head of the group, query block) in one sequence.
        let mut queries = QueryStream::<F, N>::start(inputs, &own, &dims, t);
        for i in 0..queries.count {
            let first = queries.wait(inputs, &own, &dims, i, t);
            let q0 = queries.first_query(&own, i, t);
            let q = queries.q;
            let dout = queries.dout;

            let mut p = products::<F, N>(&smem_k, row0, &q, first, 1usize, sn, ksteps, pitch);
            let mut ds = products::<F, N>(&smem_v, row0, &dout, first, 1usize, sn, ksteps, pitch);
            let full = queries_full(&own, &dims, q0, own.last, t);
            let stats = queries.stat;
            softmax_grads(
                &mut p, &mut ds, &stats, first, 0usize, q0, key_top, &key_ends, full, &own, &dims,
                1usize, sn, t,
            );
            accumulate_rows::<F, N>(&mut acc_v, &p, &dout, first, sn, vecs, pitch);
            accumulate_rows::<F, N>(&mut acc_k, &ds, &q, first, sn, vecs, pitch);
        }

        // The plane's own rows of the key and value tiles take its results.
        let scale = dims.scale;
        stage_accs::<F, N>(
            &acc_k,
            &mut smem_k,
            row0,
            0usize,
            scale,
            scale,
            0usize,
            vecs,
            pitch,
        );
        stage_accs::<F, N>(
            &acc_v,
            &mut smem_v,
            row0,
            0usize,
            1.0f32,
            1.0f32,
            0usize,
            vecs,
            pitch,
        );
        sync_plane();
        store_dk_dv::<F, N>(&smem_k, &smem_v, dk, dv, inputs, &own, row0, dims.seq_k, t);
    }
}

#[cube(launch_unchecked, fast_math = FastMath::all())]
pub(crate) fn mma_dq_kernel<F: Float, N: Size>(
    inputs: &BackwardInputs<Vector<F, N>, f32>,
    dq: &mut Tensor<Vector<F, N>>,
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
    let own = owned_rows(&dims, &inputs.key_lengths, &inputs.doc_starts, true, t);
    if own.b < dims.batch {
        let b = own.b;
        let h = own.head;
        let q0 = own.first;
        let mut smem_q =
            SharedMemory::<Vector<F, N>>::new_aligned(comptime![rows * pitch], 16usize);
        let mut smem_do =
            SharedMemory::<Vector<F, N>>::new_aligned(comptime![rows * pitch], 16usize);

        let q_rows = head_rows(&inputs.strides, b, h, Q);
        let do_rows = head_rows(&inputs.strides, b, h, DOUT);
        let hk = h / dims.group;
        let k_rows = head_rows(&inputs.strides, b, hk, K);
        let v_rows = head_rows(&inputs.strides, b, hk, V);
        let seq_q = dims.seq_q;
        load_tile::<F, N>(&inputs.q, q_rows, q0, seq_q, &mut smem_q, rows, vecs, units);
        load_tile::<F, N>(
            &inputs.dout,
            do_rows,
            q0,
            seq_q,
            &mut smem_do,
            rows,
            vecs,
            units,
        );

        let row0 = plane * 16;
        let top = q0 + row0 + lane / 4;
        let col = (lane % 4) * 2;
        let stat = (b * dims.heads + h) * seq_q;
        // `−lse` and `Δ` of the lane's two rows (scalars: this kernel has
        // no registers to spare for broadcast pairs).
        let mut neg_lse = Array::<f32>::new(2usize);
        let mut delta_r = Array::<f32>::new(2usize);
        // The first key each of the two rows sees (window, document).
        let mut lowest = Array::<usize>::new(2usize);
        #[unroll]
        for r in 0..2usize {
            let row = top + r * 8;
            let qpos = row + own.offset;
            lowest[r] = first_key(&inputs.doc_starts, b, qpos, dims.seq_k, dims.window, t);
            let real = row < seq_q;
            let at = select(real, stat + row, 0usize);
            neg_lse[r] = -select(real, inputs.lse[at], NO_ROW);
            delta_r[r] = select(real, inputs.delta[at], 0.0f32);
        }
        let mut acc = zero_accs(vecs);

        let first = own.block_first;
        let end = own.block_end;
        let mut keys = KeyStream::<F, N>::start(
            &inputs.k, &inputs.v, k_rows, v_rows, dims.seq_k, first, end, t,
        );
        for kb in own.block_first..own.block_end {
            let k0 = kb * cols;
            let stage = keys.wait(&inputs.k, &inputs.v, kb, t);
            let s = products::<F, N>(&smem_q, row0, &keys.k, stage, 1usize, sn, ksteps, pitch);
            let mut ds =
                products::<F, N>(&smem_do, row0, &keys.v, stage, 1usize, sn, ksteps, pitch);
            let full = keys_full(&own, k0, t);
            #[unroll]
            for nt in 0..sn {
                let s_acc = s.index(nt);
                let d_acc = ds.index_mut(nt);
                #[unroll]
                for r in 0..2usize {
                    let sr = s_acc[r];
                    let mut dr = d_acc[r];
                    #[unroll]
                    for e in 0..2usize {
                        let mut x = f32::exp(fma(sr[e], dims.scale, neg_lse[r]));
                        if !full {
                            let key = k0 + nt * 8 + col + e;
                            let qpos = top + r * 8 + own.offset;
                            let ok = allowed(qpos, key, lowest[r], own.klen, t);
                            x = select(ok, x, 0.0f32);
                        }
                        dr[e] = x * (dr[e] - delta_r[r]);
                    }
                    d_acc[r] = dr;
                }
            }
            accumulate_rows::<F, N>(&mut acc, &ds, &keys.k, stage, sn, vecs, pitch);
        }

        let scale = dims.scale;
        stage_accs::<F, N>(
            &acc,
            &mut smem_q,
            row0,
            0usize,
            scale,
            scale,
            0usize,
            vecs,
            pitch,
        );
        sync_plane();
        let dq_rows = head_rows(&inputs.strides, b, h, DQ);
        let first = q0 + row0;
        store_rows::<F, N>(&smem_q, row0, dq, dq_rows, first, seq_q, vecs);
    }
}
