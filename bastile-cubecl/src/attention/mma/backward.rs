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

use cubecl::prelude::barrier::{Barrier, copy_async};
use cubecl::prelude::*;

use crate::attention::AttnDims;

use super::super::backward::query_block_range;
use super::super::forward::query_block_keys;
use super::super::tile::{AttnTile, allowed, cube_coords, key_count};
use super::forward::copy_block;
use super::fragment::{
    Frag, Pair, Tile, acc_to_a, cols_base, copy_tile, load_b_cols, load_tile, mma_pair, products,
    stage_accs, store_rows, zero_accs,
};
use super::{block_full, mma_units};

/// `lse` of a query row that does not exist: its probabilities are
/// exp(−huge) = 0.
pub(crate) const NO_ROW: f32 = 3.0e38;

/// One f32 of the per-row statistics, typed as a one-element vector so a
/// staged block of them can be read in pairs.
pub(crate) type Stat = Vector<f32, Const<1>>;

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

/// Starts the copies of block `i` of the cube's sequence of (query head
/// of the group from `h0`, query block from `qb_first`; `blocks` per
/// head): its queries, output gradients and their rows' `lse` and `Δ`,
/// into stage `i % 2` of the staged tiles. Rows past the sequence get
/// zeros and an `lse` that makes their probabilities 0.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn copy_queries<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    dout: &Tensor<Vector<F, N>>,
    lse: &Tensor<Stat>,
    delta: &Tensor<Stat>,
    strides: &Sequence<usize>,
    b: usize,
    h0: usize,
    heads: usize,
    qb_first: usize,
    blocks: usize,
    i: usize,
    seq_q: usize,
    smem_q: &mut Tile<F, N>,
    smem_do: &mut Tile<F, N>,
    smem_stat: &mut SharedMemory<Stat>,
    #[comptime] t: AttnTile,
) {
    let cols = comptime![t.cols as usize];
    let vecs = comptime![t.head_dim as usize / 8];
    let units = comptime![mma_units(t)];
    let h = h0 + i / blocks;
    let q0 = (qb_first + i % blocks) * cols;
    let row0 = (i % 2) * cols;
    let q_base = b * strides[0usize] + h * strides[1usize];
    let do_base = b * strides[12usize] + h * strides[13usize];
    copy_tile::<F, N>(
        q,
        q_base,
        strides[2usize],
        q0,
        seq_q,
        smem_q,
        row0,
        cols,
        vecs,
        units,
    );
    copy_tile::<F, N>(
        dout,
        do_base,
        strides[14usize],
        q0,
        seq_q,
        smem_do,
        row0,
        cols,
        vecs,
        units,
    );
    let stat = (b * heads + h) * seq_q + q0;
    let at = 2 * row0;
    #[unroll]
    for it in 0..comptime![cols.div_ceil(units)] {
        let j = UNIT_POS as usize + it * units;
        if j < cols {
            if q0 + j < seq_q {
                copy_async(
                    &lse.slice(stat + j, stat + j + 1),
                    &mut smem_stat.slice_mut(at + j, at + j + 1),
                    1u32,
                );
                copy_async(
                    &delta.slice(stat + j, stat + j + 1),
                    &mut smem_stat.slice_mut(at + cols + j, at + cols + j + 1),
                    1u32,
                );
            } else {
                smem_stat[at + j] = Stat::new(NO_ROW);
                smem_stat[at + cols + j] = Stat::new(0.0f32);
            }
        }
    }
}

/// Loads the cube's keys and values (rows `k0 ..` of kv head `hk`, zeros
/// past the sequence) into their tiles.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn load_keys_values<F: Float, N: Size>(
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    strides: &Sequence<usize>,
    b: usize,
    hk: usize,
    k0: usize,
    seq_k: usize,
    smem_k: &mut Tile<F, N>,
    smem_v: &mut Tile<F, N>,
    #[comptime] t: AttnTile,
) {
    let rows = comptime![t.rows as usize];
    let vecs = comptime![t.head_dim as usize / 8];
    let units = comptime![mma_units(t)];
    let k_base = b * strides[3usize] + hk * strides[4usize];
    let v_base = b * strides[6usize] + hk * strides[7usize];
    load_tile::<F, N>(
        k,
        k_base,
        strides[5usize],
        k0,
        seq_k,
        smem_k,
        rows,
        vecs,
        units,
    );
    load_tile::<F, N>(
        v,
        v_base,
        strides[8usize],
        k0,
        seq_k,
        smem_v,
        rows,
        vecs,
        units,
    );
}

/// Writes the plane's 16 rows (from `row0`) of the staged dK and dV tiles
/// to rows `k0 + row0 ..` of kv head `hk`, skipping rows past the
/// sequence.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn store_dk_dv<F: Float, N: Size>(
    smem_k: &Tile<F, N>,
    smem_v: &Tile<F, N>,
    dk: &mut Tensor<Vector<F, N>>,
    dv: &mut Tensor<Vector<F, N>>,
    strides: &Sequence<usize>,
    b: usize,
    hk: usize,
    k0: usize,
    row0: usize,
    seq_k: usize,
    #[comptime] t: AttnTile,
) {
    let vecs = comptime![t.head_dim as usize / 8];
    let dk_base = b * strides[18usize] + hk * strides[19usize];
    let dv_base = b * strides[21usize] + hk * strides[22usize];
    store_rows::<F, N>(
        smem_k,
        row0,
        dk,
        dk_base,
        strides[20usize],
        k0 + row0,
        seq_k,
        vecs,
    );
    store_rows::<F, N>(
        smem_v,
        row0,
        dv,
        dv_base,
        strides[23usize],
        k0 + row0,
        seq_k,
        vecs,
    );
}

/// Turns a plane's `Sᵀ` and `dPᵀ` accumulators (`mt` tiles of 16 keys,
/// the lane's first row `key_top`, by `8·sn` queries from column `qoff` of
/// the block at `q_pos`) into `Pᵀ = exp(scale·Sᵀ − lse)` and
/// `dSᵀ = Pᵀ ⊙ (dPᵀ − Δ)`, zero where the query may not see the key
/// (checked only when the block is not `full`). The block's statistics
/// are staged from row `first` of `smem_stat`'s stage: `lse` then `Δ`,
/// read as the lane's pairs of columns.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn softmax_grads(
    p: &mut Sequence<Frag<f32>>,
    ds: &mut Sequence<Frag<f32>>,
    smem_stat: &SharedMemory<Stat>,
    first: usize,
    qoff: usize,
    q_pos: usize,
    key_top: usize,
    full: bool,
    klen: usize,
    window: usize,
    scale: f32,
    #[comptime] mt: usize,
    #[comptime] sn: usize,
    #[comptime] t: AttnTile,
) {
    // One test per block: a block seen whole runs no per-element check.
    if full {
        block_grads(
            p, ds, smem_stat, first, qoff, q_pos, key_top, klen, window, scale, false, mt, sn, t,
        );
    } else {
        block_grads(
            p, ds, smem_stat, first, qoff, q_pos, key_top, klen, window, scale, true, mt, sn, t,
        );
    }
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
    klen: usize,
    window: usize,
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
                        x[e] = select(allowed(q_pos + c, key, klen, window, t), x[e], 0.0f32);
                    }
                }
                d_acc[r] = x * (d_acc[r] - dlt);
                s_acc[r] = x;
            }
        }
    }
}

#[cube(launch_unchecked, fast_math = FastMath::all())]
#[allow(clippy::too_many_arguments)]
pub(crate) fn mma_dkdv_kernel<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    dout: &Tensor<Vector<F, N>>,
    lse: &Tensor<Stat>,
    delta: &Tensor<Stat>,
    key_lengths: &Tensor<i32>,
    dk: &mut Tensor<Vector<F, N>>,
    dv: &mut Tensor<Vector<F, N>>,
    strides: Sequence<usize>,
    dims: AttnDims,
    #[comptime] t: AttnTile,
    #[define(F)] _dtype: StorageType,
) {
    let rows = comptime![t.rows as usize];
    let cols = comptime![t.cols as usize];
    let vecs = comptime![t.head_dim as usize / 8];
    let pitch = comptime![t.head_dim as usize / 8 + 1];
    let ksteps = comptime![t.head_dim as usize / 16];
    let sn = comptime![t.cols as usize / 8];
    let lane = UNIT_POS_PLANE as usize;
    let plane = UNIT_POS as usize / 32;
    let kv_heads = dims.heads / dims.group;
    let (b, hk, kb) = cube_coords(dims.blocks, kv_heads, dims.batch, false, t);
    if b < dims.batch {
        let k0 = kb * rows;
        let klen = key_count(key_lengths, b, dims.seq_k, t);
        let offset = dims.seq_k - dims.seq_q;
        let k_last = select(k0 + rows < dims.seq_k, k0 + rows, dims.seq_k) - 1;
        let (qb_first, qb_end) = query_block_range(k0, k_last, dims.seq_q, offset, dims.window, t);

        let mut smem_k =
            SharedMemory::<Vector<F, N>>::new_aligned(comptime![rows * pitch], 16usize);
        let mut smem_v =
            SharedMemory::<Vector<F, N>>::new_aligned(comptime![rows * pitch], 16usize);
        // Two stages of query blocks: the next block's copies fly while
        // this one is multiplied.
        let mut smem_q =
            SharedMemory::<Vector<F, N>>::new_aligned(comptime![2 * cols * pitch], 16usize);
        let mut smem_do =
            SharedMemory::<Vector<F, N>>::new_aligned(comptime![2 * cols * pitch], 16usize);
        let mut smem_stat = SharedMemory::<Stat>::new_aligned(comptime![4 * cols], 16usize);
        let barrier = Barrier::shared(CUBE_DIM, UNIT_POS == 0);

        load_keys_values::<F, N>(
            k,
            v,
            &strides,
            b,
            hk,
            k0,
            dims.seq_k,
            &mut smem_k,
            &mut smem_v,
            t,
        );

        let row0 = plane * 16;
        let key_top = k0 + row0 + lane / 4;
        let mut acc_k = zero_accs(vecs);
        let mut acc_v = zero_accs(vecs);

        // Every (query head of the group, query block) in one sequence.
        let blocks = select(qb_end > qb_first, qb_end - qb_first, 0usize);
        let total = dims.group * blocks;
        if total > 0 {
            copy_queries::<F, N>(
                q,
                dout,
                lse,
                delta,
                &strides,
                b,
                hk * dims.group,
                dims.heads,
                qb_first,
                blocks,
                0usize,
                dims.seq_q,
                &mut smem_q,
                &mut smem_do,
                &mut smem_stat,
                t,
            );
        }
        for i in 0..total {
            barrier.commit_copy_async();
            barrier.arrive_and_wait();
            // Every unit is past the previous block: its stage is free.
            if i + 1 < total {
                copy_queries::<F, N>(
                    q,
                    dout,
                    lse,
                    delta,
                    &strides,
                    b,
                    hk * dims.group,
                    dims.heads,
                    qb_first,
                    blocks,
                    i + 1,
                    dims.seq_q,
                    &mut smem_q,
                    &mut smem_do,
                    &mut smem_stat,
                    t,
                );
            }
            let q0 = (qb_first + i % blocks) * cols;
            let first = (i % 2) * cols;

            let mut p = products::<F, N>(&smem_k, row0, &smem_q, first, 1usize, sn, ksteps, pitch);
            let mut ds =
                products::<F, N>(&smem_v, row0, &smem_do, first, 1usize, sn, ksteps, pitch);
            let q_last = select(q0 + cols < dims.seq_q, q0 + cols, dims.seq_q) - 1;
            let full = block_full(
                q0 + offset,
                q_last + offset,
                k0,
                k_last,
                klen,
                dims.window,
                t,
            );
            softmax_grads(
                &mut p,
                &mut ds,
                &smem_stat,
                first,
                0usize,
                q0 + offset,
                key_top,
                full,
                klen,
                dims.window,
                dims.scale,
                1usize,
                sn,
                t,
            );
            accumulate_rows::<F, N>(&mut acc_v, &p, &smem_do, first, sn, vecs, pitch);
            accumulate_rows::<F, N>(&mut acc_k, &ds, &smem_q, first, sn, vecs, pitch);
        }

        // The plane's own rows of the key and value tiles take its results.
        stage_accs::<F, N>(
            &acc_k,
            &mut smem_k,
            row0,
            0usize,
            dims.scale,
            dims.scale,
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
        store_dk_dv::<F, N>(
            &smem_k, &smem_v, dk, dv, &strides, b, hk, k0, row0, dims.seq_k, t,
        );
    }
}

#[cube(launch_unchecked, fast_math = FastMath::all())]
#[allow(clippy::too_many_arguments)]
pub(crate) fn mma_dq_kernel<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    dout: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    key_lengths: &Tensor<i32>,
    dq: &mut Tensor<Vector<F, N>>,
    strides: Sequence<usize>,
    dims: AttnDims,
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
    let (b, h, qb) = cube_coords(dims.blocks, dims.heads, dims.batch, true, t);
    if b < dims.batch {
        let hk = h / dims.group;
        let q0 = qb * rows;
        let klen = key_count(key_lengths, b, dims.seq_k, t);
        let (offset, kb_first, kb_end) =
            query_block_keys(q0, dims.seq_q, dims.seq_k, klen, dims.window, t);
        let q_last = select(q0 + rows < dims.seq_q, q0 + rows, dims.seq_q) - 1;

        let mut smem_q =
            SharedMemory::<Vector<F, N>>::new_aligned(comptime![rows * pitch], 16usize);
        let mut smem_do =
            SharedMemory::<Vector<F, N>>::new_aligned(comptime![rows * pitch], 16usize);
        let mut smem_k =
            SharedMemory::<Vector<F, N>>::new_aligned(comptime![2 * cols * pitch], 16usize);
        let mut smem_v =
            SharedMemory::<Vector<F, N>>::new_aligned(comptime![2 * cols * pitch], 16usize);
        let barrier = Barrier::shared(CUBE_DIM, UNIT_POS == 0);

        let q_base = b * strides[0usize] + h * strides[1usize];
        let do_base = b * strides[12usize] + h * strides[13usize];
        let k_base = b * strides[3usize] + hk * strides[4usize];
        let v_base = b * strides[6usize] + hk * strides[7usize];
        load_tile::<F, N>(
            q,
            q_base,
            strides[2usize],
            q0,
            dims.seq_q,
            &mut smem_q,
            rows,
            vecs,
            units,
        );
        load_tile::<F, N>(
            dout,
            do_base,
            strides[14usize],
            q0,
            dims.seq_q,
            &mut smem_do,
            rows,
            vecs,
            units,
        );

        let row0 = plane * 16;
        let top = q0 + row0 + lane / 4;
        let col = (lane % 4) * 2;
        let stat = (b * dims.heads + h) * dims.seq_q;
        // `−lse` and `Δ` of the lane's two rows (scalars: this kernel has
        // no registers to spare for broadcast pairs).
        let mut neg_lse = Array::<f32>::new(2usize);
        let mut delta_r = Array::<f32>::new(2usize);
        #[unroll]
        for r in 0..2usize {
            let row = top + r * 8;
            let real = row < dims.seq_q;
            let at = select(real, stat + row, 0usize);
            neg_lse[r] = -select(real, lse[at], NO_ROW);
            delta_r[r] = select(real, delta[at], 0.0f32);
        }
        let mut acc = zero_accs(vecs);

        if kb_first < kb_end {
            copy_block::<F, N>(
                k,
                v,
                k_base,
                v_base,
                &strides,
                kb_first * cols,
                dims.seq_k,
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
            let stage = (kb - kb_first) % 2 * cols;
            if kb + 1 < kb_end {
                copy_block::<F, N>(
                    k,
                    v,
                    k_base,
                    v_base,
                    &strides,
                    k0 + cols,
                    dims.seq_k,
                    &mut smem_k,
                    &mut smem_v,
                    cols - stage,
                    t,
                );
            }

            let s = products::<F, N>(&smem_q, row0, &smem_k, stage, 1usize, sn, ksteps, pitch);
            let mut ds =
                products::<F, N>(&smem_do, row0, &smem_v, stage, 1usize, sn, ksteps, pitch);
            let k_last = k0 + cols - 1;
            let full = block_full(
                q0 + offset,
                q_last + offset,
                k0,
                k_last,
                klen,
                dims.window,
                t,
            );
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
                            let ok = allowed(top + r * 8 + offset, key, klen, dims.window, t);
                            x = select(ok, x, 0.0f32);
                        }
                        dr[e] = x * (dr[e] - delta_r[r]);
                    }
                    d_acc[r] = dr;
                }
            }
            accumulate_rows::<F, N>(&mut acc, &ds, &smem_k, stage, sn, vecs, pitch);
        }

        stage_accs::<F, N>(
            &acc,
            &mut smem_q,
            row0,
            0usize,
            dims.scale,
            dims.scale,
            0usize,
            vecs,
            pitch,
        );
        sync_plane();
        store_rows::<F, N>(
            &smem_q,
            row0,
            dq,
            b * strides[15usize] + h * strides[16usize],
            strides[17usize],
            q0 + row0,
            dims.seq_q,
            vecs,
        );
    }
}
