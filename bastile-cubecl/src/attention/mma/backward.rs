//! The tensor-core backward, flash-attention-2 style, in two kernels that
//! each own what they write (no atomics, deterministic):
//!
//! * `dkdv`: one cube per (batch, kv head, block of `16·planes` keys), one
//!   plane per 16 keys. For every query head of the group and every query
//!   block that sees its keys it forms `Sᵀ = K·Qᵀ` and `dPᵀ = V·dOᵀ` in
//!   registers, then `Pᵀ = exp(scale·Sᵀ − lse)` and
//!   `dSᵀ = Pᵀ ⊙ (dPᵀ − Δ)`, and accumulates `dV += Pᵀ·dO`,
//!   `dK += dSᵀ·Q` with the probabilities as the A operand.
//! * `dq`: one cube per (batch, query head, block of `16·planes` queries),
//!   forming `S`, `dP`, `dS` the same way for each key block its rows see
//!   and accumulating `dQ += dS·K`.
//!
//! `Δ` and the sink gradient come from the tiled path's row kernel.

use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use super::super::backward::query_block_range;
use super::super::forward::query_block_keys;
use super::super::tile::{AttnTile, allowed, key_count};
use super::forward::copy_block;
use super::fragment::{
    Frag, Tile, acc_to_a, half, load_a, load_b_cols, load_b_rows, load_tile, mma, stage_rows,
    store_rows, zero_accs,
};
use super::{block_full, mma_cube_coords};

/// `lse` of a query row that does not exist: its probabilities are
/// exp(−huge) = 0.
const NO_ROW: f32 = 3.0e38;

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

#[cube(launch_unchecked, fast_math = FastMath::all())]
#[allow(clippy::too_many_arguments)]
pub(crate) fn mma_dkdv_kernel<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    dout: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    key_lengths: &Tensor<i32>,
    dk: &mut Tensor<Vector<F, N>>,
    dv: &mut Tensor<Vector<F, N>>,
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
        let mut smem_q =
            SharedMemory::<Vector<F, N>>::new_aligned(comptime![cols * pitch], 16usize);
        let mut smem_do =
            SharedMemory::<Vector<F, N>>::new_aligned(comptime![cols * pitch], 16usize);
        let mut smem_stat = SharedMemory::<f32>::new(comptime![2 * cols]);

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

        for g in 0..group {
            let h = hk * group + g;
            let q_base = b * strides[0usize] + h * strides[1usize];
            let do_base = b * strides[12usize] + h * strides[13usize];
            let stat_base = (b * heads + h) * seq_q;
            for qb in qb_first..qb_end {
                let q0 = qb * cols;
                sync_cube();
                load_tile::<F, N>(
                    q,
                    q_base,
                    strides[2usize],
                    q0,
                    seq_q,
                    &mut smem_q,
                    cols,
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
                    cols,
                    vecs,
                    units,
                );
                #[unroll]
                for it in 0..comptime![cols.div_ceil(units)] {
                    let i = UNIT_POS as usize + it * units;
                    if i < cols {
                        let real = q0 + i < seq_q;
                        let row = select(real, stat_base + q0 + i, 0usize);
                        smem_stat[i] = select(real, lse[row], NO_ROW);
                        smem_stat[cols + i] = select(real, delta[row], 0.0f32);
                    }
                }
                sync_cube();

                let mut p = products::<F, N>(&smem_k, row0, &smem_q, 0usize, sn, ksteps, pitch);
                let mut ds = products::<F, N>(&smem_v, row0, &smem_do, 0usize, sn, ksteps, pitch);
                let q_last = select(q0 + cols < seq_q, q0 + cols, seq_q) - 1;
                let full = block_full(q0 + offset, q_last + offset, k0, k_last, klen, window, t);
                #[unroll]
                for nt in 0..sn {
                    let s_acc = p.index_mut(nt);
                    let d_acc = ds.index_mut(nt);
                    #[unroll]
                    for r in 0..2usize {
                        let mut pr = s_acc[r];
                        let mut dr = d_acc[r];
                        #[unroll]
                        for e in 0..2usize {
                            let c = nt * 8 + col + e;
                            let mut x = f32::exp(pr[e] * scale - smem_stat[c]);
                            if !full {
                                let ok = allowed(q0 + c + offset, key_top + r * 8, klen, window, t);
                                x = select(ok, x, 0.0f32);
                            }
                            pr[e] = x;
                            dr[e] = x * (dr[e] - smem_stat[cols + c]);
                        }
                        s_acc[r] = pr;
                        d_acc[r] = dr;
                    }
                }
                accumulate_rows::<F, N>(&mut acc_v, &p, &smem_do, 0usize, sn, vecs, pitch);
                accumulate_rows::<F, N>(&mut acc_k, &ds, &smem_q, 0usize, sn, vecs, pitch);
            }
        }

        // The plane's own rows of the key and value tiles take its results.
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
        let mut lse_r = Array::<f32>::new(2usize);
        let mut delta_r = Array::<f32>::new(2usize);
        #[unroll]
        for r in 0..2usize {
            let row = top + r * 8;
            let real = row < seq_q;
            let at = select(real, stat + row, 0usize);
            lse_r[r] = select(real, lse[at], NO_ROW);
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
                        let mut x = f32::exp(sr[e] * scale - lse_r[r]);
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
