//! The tensor-core backward, flash-attention-2 style, in one of two forms
//! the tuner picks between:
//!
//! * `dkdv`: one cube per (batch, kv head, block of `16·planes` keys), one
//!   plane per 16 keys. For every query head of the group and every query
//!   block that sees its keys (streamed through two stages of shared
//!   memory by asynchronous copies) it forms `Sᵀ = K·Qᵀ` and `dPᵀ = V·dOᵀ`
//!   in registers, then `Pᵀ = exp(scale·Sᵀ − lse)` and
//!   `dSᵀ = Pᵀ ⊙ (dPᵀ − Δ)`, and accumulates `dV += Pᵀ·dO`,
//!   `dK += dSᵀ·Q` with the probabilities as the A operand.
//! * Deterministic: a separate `dq` kernel, one cube per (batch, query
//!   head, block of `16·planes` queries), forms `S`, `dP`, `dS` again for
//!   each key block its rows see and accumulates `dQ += dS·K`: seven
//!   products per block pair, every output owned by one cube.
//! * Fused: the `dkdv` kernel also stages `dS` in shared memory and adds
//!   `dS·K` into an f32 dQ accumulator with atomics (five products per
//!   block pair; the order of the additions, so the last bits of dQ, vary
//!   from run to run), which `dq_sum` zeroes beforehand and rounds after.
//!
//! `Δ` and the sink gradient come from the tiled path's row kernel.

use cubecl::prelude::barrier::{Barrier, copy_async};
use cubecl::prelude::*;

use super::super::backward::query_block_range;
use super::super::forward::query_block_keys;
use super::super::tile::{AttnTile, allowed, key_count};
use super::forward::copy_block;
use super::fragment::{
    Frag, Pair, Tile, acc_to_a, copy_tile, half, load_a, load_b_cols, load_b_rows, load_tile, mma,
    stage_rows, store_rows, zero_accs,
};
use super::{block_full, mma_cube_coords};

/// `lse` of a query row that does not exist: its probabilities are
/// exp(−huge) = 0.
const NO_ROW: f32 = 3.0e38;

/// One f32 of the per-row statistics, typed as a one-element vector so a
/// staged block of them can be read in pairs.
type Stat = Vector<f32, Const<1>>;
/// Four f32 of a dQ row, what one atomic addition takes.
type Quad = Vector<f32, Const<4>>;

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
    #[unroll]
    for kk in 0..comptime![sn / 2] {
        let a = acc_to_a::<F>(weights, kk);
        #[unroll]
        for dp in 0..comptime![vecs / 2] {
            let pair = load_b_cols::<F, N>(tile, first + kk * 16, dp * 16, pitch);
            mma::<F>(&a, &half::<F>(&pair, 0usize), acc.index_mut(2 * dp));
            mma::<F>(&a, &half::<F>(&pair, 2usize), acc.index_mut(2 * dp + 1));
        }
    }
}

/// `n = sn` accumulators of `A · Bᵀ`: rows `row0 .. row0 + 16` of tile `a`
/// against rows `first .. first + 8·sn` of tile `b` (both row-major over
/// the head dim).
#[cube]
fn products<F: Float, N: Size>(
    a: &Tile<F, N>,
    row0: usize,
    b: &Tile<F, N>,
    first: usize,
    #[comptime] sn: usize,
    #[comptime] ksteps: usize,
    #[comptime] pitch: usize,
) -> Sequence<Frag<f32>> {
    let mut acc = zero_accs(sn);
    #[unroll]
    for ks in 0..ksteps {
        let frag = load_a::<F, N>(a, row0, ks * 16, pitch);
        #[unroll]
        for np in 0..comptime![sn / 2] {
            let pair = load_b_rows::<F, N>(b, first + np * 16, ks * 16, pitch);
            mma::<F>(&frag, &half::<F>(&pair, 0usize), acc.index_mut(2 * np));
            mma::<F>(&frag, &half::<F>(&pair, 2usize), acc.index_mut(2 * np + 1));
        }
    }
    acc
}

/// Starts the copies of query block `q0 ..` of head `h` (queries, output
/// gradients and their rows' `lse` and `Δ`) into stage `stage` (0 or 1)
/// of the staged tiles; rows past the sequence get zeros and an `lse`
/// that makes their probabilities 0.
#[cube]
#[allow(clippy::too_many_arguments)]
fn copy_queries<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    dout: &Tensor<Vector<F, N>>,
    lse: &Tensor<Stat>,
    delta: &Tensor<Stat>,
    strides: &Sequence<usize>,
    b: usize,
    h: usize,
    heads: usize,
    q0: usize,
    seq_q: usize,
    smem_q: &mut Tile<F, N>,
    smem_do: &mut Tile<F, N>,
    smem_stat: &mut SharedMemory<Stat>,
    stage: usize,
    #[comptime] t: AttnTile,
) {
    let cols = comptime![t.cols as usize];
    let vecs = comptime![t.head_dim as usize / 8];
    let units = comptime![t.rows as usize * 2];
    let row0 = stage * cols;
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
        let i = UNIT_POS as usize + it * units;
        if i < cols {
            if q0 + i < seq_q {
                copy_async(
                    &lse.slice(stat + i, stat + i + 1),
                    &mut smem_stat.slice_mut(at + i, at + i + 1),
                    1u32,
                );
                copy_async(
                    &delta.slice(stat + i, stat + i + 1),
                    &mut smem_stat.slice_mut(at + cols + i, at + cols + i + 1),
                    1u32,
                );
            } else {
                smem_stat[at + i] = Stat::new(NO_ROW);
                smem_stat[at + cols + i] = Stat::new(0.0f32);
            }
        }
    }
}

/// `dQ += dS·K` for one query block, spread over the cube: `dS` (queries
/// by the cube's keys, in shared memory) times the key tile, each plane
/// taking 16 queries by 16 head-dim columns at a time and adding them to
/// the f32 accumulator `dq_acc` (`[batch, heads, seq_q, d]`, in fours).
#[cube]
#[allow(clippy::too_many_arguments)]
fn add_dq<F: Float, N: Size>(
    smem_ds: &Tile<F, N>,
    smem_k: &Tile<F, N>,
    dq_acc: &mut Tensor<Atomic<Quad>>,
    row_base: usize,
    q0: usize,
    seq_q: usize,
    #[comptime] t: AttnTile,
) {
    let rows = comptime![t.rows as usize];
    let d = comptime![t.head_dim as usize];
    let pitch = comptime![t.head_dim as usize / 8 + 1];
    let ds_pitch = comptime![t.rows as usize / 8 + 1];
    let planes = comptime![t.rows as usize / 16];
    let mtiles = comptime![t.cols as usize / 16];
    let items = comptime![t.cols as usize / 16 * (t.head_dim as usize / 16)];
    let lane = UNIT_POS_PLANE as usize;
    let plane = UNIT_POS as usize / 32;
    #[unroll]
    for it in 0..comptime![items.div_ceil(planes)] {
        let w = plane + it * planes;
        if w < items {
            let m = w % mtiles;
            let c0 = (w / mtiles) * 16;
            let mut acc = zero_accs(2usize);
            #[unroll]
            for ks in 0..comptime![rows / 16] {
                let a = load_a::<F, N>(smem_ds, m * 16, ks * 16, ds_pitch);
                let pair = load_b_cols::<F, N>(smem_k, ks * 16, c0, pitch);
                mma::<F>(&a, &half::<F>(&pair, 0usize), acc.index_mut(0usize));
                mma::<F>(&a, &half::<F>(&pair, 2usize), acc.index_mut(1usize));
            }
            // Lanes 2u and 2u + 1 trade halves so that each holds four
            // neighbouring columns of one row (the even lane of row `g`,
            // the odd of row `g + 8`): one 16-byte atomic each.
            let odd = lane % 2 == 1;
            let row = q0 + m * 16 + lane / 4 + select(odd, 8usize, 0usize);
            let col = c0 + (lane % 4) / 2 * 4;
            #[unroll]
            for j in 0..2usize {
                let a = acc.index(j);
                let send = select(odd, a[0usize], a[1usize]);
                let keep = select(odd, a[1usize], a[0usize]);
                let got0 = plane_shuffle_xor(send[0usize], 1u32);
                let got1 = plane_shuffle_xor(send[1usize], 1u32);
                let mut quad = Quad::new(0.0f32);
                quad[0usize] = select(odd, got0, keep[0usize]);
                quad[1usize] = select(odd, got1, keep[1usize]);
                quad[2usize] = select(odd, keep[0usize], got0);
                quad[3usize] = select(odd, keep[1usize], got1);
                if row < seq_q {
                    dq_acc[((row_base + row) * d + col + j * 8) / 4].fetch_add(quad);
                }
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
    dq_acc: &mut Tensor<Atomic<Quad>>,
    strides: Sequence<usize>,
    batch: usize,
    heads: usize,
    group: usize,
    seq_q: usize,
    seq_k: usize,
    k_blocks: usize,
    window: usize,
    scale: f32,
    #[comptime] t: AttnTile,
    #[comptime] with_dq: bool,
    #[define(F)] _dtype: StorageType,
) {
    let rows = comptime![t.rows as usize];
    let cols = comptime![t.cols as usize];
    let vecs = comptime![t.head_dim as usize / 8];
    let pitch = comptime![t.head_dim as usize / 8 + 1];
    let units = comptime![t.rows as usize * 2];
    let ksteps = comptime![t.head_dim as usize / 16];
    let sn = comptime![t.cols as usize / 8];
    let ds_pitch = comptime![t.rows as usize / 8 + 1];
    let lane = UNIT_POS_PLANE as usize;
    let plane = UNIT_POS as usize / 32;
    let kv_heads = heads / group;
    let (b, hk, kb) = mma_cube_coords(k_blocks, kv_heads, false, t);
    if b < batch {
        let k0 = kb * rows;
        let klen = key_count(key_lengths, b, seq_k, t);
        let offset = seq_k - seq_q;
        let k_last = select(k0 + rows < seq_k, k0 + rows, seq_k) - 1;
        let (qb_first, qb_end) = query_block_range(k0, k_last, seq_q, offset, window, t);

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
        // dS of the block, queries by keys (only with the fused dQ).
        let mut smem_ds = SharedMemory::<Vector<F, N>>::new_aligned(
            comptime![if with_dq { cols * ds_pitch } else { 1 }],
            16usize,
        );
        let barrier = Barrier::shared(CUBE_DIM, UNIT_POS == 0);

        let k_base = b * strides[3usize] + hk * strides[4usize];
        let v_base = b * strides[6usize] + hk * strides[7usize];
        load_tile::<F, N>(
            k,
            k_base,
            strides[5usize],
            k0,
            seq_k,
            &mut smem_k,
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
            &mut smem_v,
            rows,
            vecs,
            units,
        );

        let row0 = plane * 16;
        let key_top = k0 + row0 + lane / 4;
        let col = (lane % 4) * 2;
        let mut acc_k = zero_accs(vecs);
        let mut acc_v = zero_accs(vecs);

        // Every (query head of the group, query block) in one sequence.
        let blocks = select(qb_end > qb_first, qb_end - qb_first, 0usize);
        let total = group * blocks;
        if total > 0 {
            copy_queries::<F, N>(
                q,
                dout,
                lse,
                delta,
                &strides,
                b,
                hk * group,
                heads,
                qb_first * cols,
                seq_q,
                &mut smem_q,
                &mut smem_do,
                &mut smem_stat,
                0usize,
                t,
            );
        }
        for i in 0..total {
            barrier.commit_copy_async();
            barrier.arrive_and_wait();
            // Every unit is past the previous block: its stage is free.
            let stage = i % 2;
            if i + 1 < total {
                copy_queries::<F, N>(
                    q,
                    dout,
                    lse,
                    delta,
                    &strides,
                    b,
                    hk * group + (i + 1) / blocks,
                    heads,
                    (qb_first + (i + 1) % blocks) * cols,
                    seq_q,
                    &mut smem_q,
                    &mut smem_do,
                    &mut smem_stat,
                    1 - stage,
                    t,
                );
            }
            let h = hk * group + i / blocks;
            let q0 = (qb_first + i % blocks) * cols;
            let first = stage * cols;
            let st = 2 * first;

            let mut p = products::<F, N>(&smem_k, row0, &smem_q, first, sn, ksteps, pitch);
            let mut ds = products::<F, N>(&smem_v, row0, &smem_do, first, sn, ksteps, pitch);
            let q_last = select(q0 + cols < seq_q, q0 + cols, seq_q) - 1;
            let full = block_full(q0 + offset, q_last + offset, k0, k_last, klen, window, t);
            // The lane's columns are pairs: one 8-byte load of `lse` and
            // one of `Δ` per accumulator.
            let stats = smem_stat.to_slice().with_vector_size::<Const<2>>();
            #[unroll]
            for nt in 0..sn {
                let s_acc = p.index_mut(nt);
                let d_acc = ds.index_mut(nt);
                let at = (st + nt * 8 + col) / 2;
                let neg_lse = Pair::<f32>::new(0.0f32) - stats[at];
                let dlt = stats[at + cols / 2];
                #[unroll]
                for r in 0..2usize {
                    let mut x = fma(s_acc[r], Pair::<f32>::new(scale), neg_lse).exp();
                    if !full {
                        #[unroll]
                        for e in 0..2usize {
                            let c = nt * 8 + col + e;
                            let ok = allowed(q0 + c + offset, key_top + r * 8, klen, window, t);
                            x[e] = select(ok, x[e], 0.0f32);
                        }
                    }
                    d_acc[r] = x * (d_acc[r] - dlt);
                    s_acc[r] = x;
                }
            }
            if comptime![with_dq] {
                stage_ds::<F, N>(&ds, &mut smem_ds, row0, key_top, seq_k, t);
            }
            accumulate_rows::<F, N>(&mut acc_v, &p, &smem_do, first, sn, vecs, pitch);
            accumulate_rows::<F, N>(&mut acc_k, &ds, &smem_q, first, sn, vecs, pitch);
            if comptime![with_dq] {
                sync_cube();
                add_dq::<F, N>(
                    &smem_ds,
                    &smem_k,
                    dq_acc,
                    (b * heads + h) * seq_q,
                    q0,
                    seq_q,
                    t,
                );
            }
        }

        // The plane's own rows of the key and value tiles take its results
        // (once every plane is done reading the key tile for dQ).
        if comptime![with_dq] {
            sync_cube();
        }
        stage_rows::<F, N>(&acc_k, &mut smem_k, row0, scale, scale, vecs);
        stage_rows::<F, N>(&acc_v, &mut smem_v, row0, 1.0f32, 1.0f32, vecs);
        sync_plane();
        store_rows::<F, N>(
            &smem_k,
            row0,
            dk,
            b * strides[18usize] + hk * strides[19usize],
            strides[20usize],
            k0 + row0,
            seq_k,
            vecs,
        );
        store_rows::<F, N>(
            &smem_v,
            row0,
            dv,
            b * strides[21usize] + hk * strides[22usize],
            strides[23usize],
            k0 + row0,
            seq_k,
            vecs,
        );
    }
}

/// Writes a plane's `dSᵀ` accumulators (its 16 keys by the block's
/// queries) into the `dS` tile, queries by keys, rounded to the input
/// dtype; keys past the sequence (zero rows of the key tile) write 0 so
/// no overflowed probability of a missing key reaches dQ.
#[cube]
fn stage_ds<F: Float, N: Size>(
    ds: &Sequence<Frag<f32>>,
    tile: &mut Tile<F, N>,
    row0: usize,
    key_top: usize,
    seq_k: usize,
    #[comptime] t: AttnTile,
) {
    let sn = comptime![t.cols as usize / 8];
    let ds_pitch = comptime![(t.rows as usize / 8 + 1) * 8];
    let lane = UNIT_POS_PLANE as usize;
    let col = (lane % 4) * 2;
    let mut scalars = tile.to_slice_mut().with_vector_size::<Const<1>>();
    #[unroll]
    for nt in 0..sn {
        let acc = ds.index(nt);
        #[unroll]
        for r in 0..2usize {
            let key = row0 + lane / 4 + r * 8;
            let keep = key_top + r * 8 < seq_k;
            let pair = acc[r];
            #[unroll]
            for e in 0..2usize {
                let query = nt * 8 + col + e;
                let x = select(keep, pair[e], 0.0f32);
                scalars[query * ds_pitch + key] = Vector::<F, Const<1>>::new(F::cast_from(x));
            }
        }
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
    let units = comptime![t.rows as usize * 2];
    let ksteps = comptime![t.head_dim as usize / 16];
    let sn = comptime![t.cols as usize / 8];
    let lane = UNIT_POS_PLANE as usize;
    let plane = UNIT_POS as usize / 32;
    let (b, h, qb) = mma_cube_coords(q_blocks, heads, true, t);
    if b < batch {
        let hk = h / group;
        let q0 = qb * rows;
        let klen = key_count(key_lengths, b, seq_k, t);
        let (offset, kb_first, kb_end) = query_block_keys(q0, seq_q, seq_k, klen, window, t);
        let q_last = select(q0 + rows < seq_q, q0 + rows, seq_q) - 1;

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
            seq_q,
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
            seq_q,
            &mut smem_do,
            rows,
            vecs,
            units,
        );

        let row0 = plane * 16;
        let top = q0 + row0 + lane / 4;
        let col = (lane % 4) * 2;
        let stat = (b * heads + h) * seq_q;
        // `−lse` and `Δ` of the lane's two rows (scalars: this kernel has
        // no registers to spare for broadcast pairs).
        let mut neg_lse = Array::<f32>::new(2usize);
        let mut delta_r = Array::<f32>::new(2usize);
        #[unroll]
        for r in 0..2usize {
            let row = top + r * 8;
            let real = row < seq_q;
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

            let s = products::<F, N>(&smem_q, row0, &smem_k, stage, sn, ksteps, pitch);
            let mut ds = products::<F, N>(&smem_do, row0, &smem_v, stage, sn, ksteps, pitch);
            let k_last = k0 + cols - 1;
            let full = block_full(q0 + offset, q_last + offset, k0, k_last, klen, window, t);
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
                        let mut x = f32::exp(fma(sr[e], scale, neg_lse[r]));
                        if !full {
                            let key = k0 + nt * 8 + col + e;
                            let ok = allowed(top + r * 8 + offset, key, klen, window, t);
                            x = select(ok, x, 0.0f32);
                        }
                        dr[e] = x * (dr[e] - delta_r[r]);
                    }
                    d_acc[r] = dr;
                }
            }
            accumulate_rows::<F, N>(&mut acc, &ds, &smem_k, stage, sn, vecs, pitch);
        }

        stage_rows::<F, N>(&acc, &mut smem_q, row0, scale, scale, vecs);
        sync_plane();
        store_rows::<F, N>(
            &smem_q,
            row0,
            dq,
            b * strides[15usize] + h * strides[16usize],
            strides[17usize],
            q0 + row0,
            seq_q,
            vecs,
        );
    }
}
