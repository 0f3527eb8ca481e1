//! The fused tensor-core backward: one kernel forms dK, dV and (through
//! f32 atomics) dQ, five products per block pair, with every warp tile two
//! fragments tall so that each B fragment read from shared memory feeds
//! two products.
//!
//! One cube per (batch, kv head, block of `16·planes` keys). For every
//! query head of the group and every block of `cols` queries that sees
//! its keys (streamed through two stages of shared memory by asynchronous
//! copies), in three phases separated by cube barriers:
//!
//! 1. `Sᵀ = K·Qᵀ` and `dPᵀ = V·dOᵀ`, the planes laid out as `planes/2`
//!    tiles of 32 keys by two halves of the queries; `Pᵀ` and
//!    `dSᵀ = Pᵀ ⊙ (dPᵀ − Δ)` go to shared memory, rounded to the input
//!    dtype.
//! 2. `dV += Pᵀ·dO` and `dK += dSᵀ·Q`, each plane owning 32 keys by half
//!    the head dim of both accumulators, for the whole loop.
//! 3. `dQ += dS·K` (`dS` read transposed from the `dSᵀ` tile), each plane
//!    taking 32 queries by a slice of the head dim, staged in shared
//!    memory and added into the f32 accumulator `dq_acc` with 16-byte
//!    atomics over whole rows; the Δ kernel zeroes it
//!    before and `dq_sum` scales and rounds it into dQ after. The order of
//!    the additions, so the last bits of dQ, vary from run to run.

use cubecl::prelude::*;

use crate::attention::AttnDims;

use super::super::tile::{AttnTile, owned_rows};
use super::backward::{KeySideInputs, lane_key_ends, load_keys_values, softmax_grads, store_dk_dv};
use super::fragment::{Frag, accumulate_tiles, products, stage_accs, zero_accs};
use super::queries_full;
use super::stream::QueryStream;

/// Four f32 of a dQ row, what one atomic addition takes.
type Quad = Vector<f32, Const<4>>;

/// Planes along the queries of a dQ tile (32 queries each) for a block of
/// `cols` queries; the others split the head dim.
pub(crate) fn dq_query_planes(cols: usize) -> usize {
    cols / 32
}

/// f32 per row of a plane's dQ staging tile (`n` accumulators of 8
/// columns): the tile's width plus 8, so that the pair stores of each
/// half-plane (rows `g`, columns `2·(lane % 4)`) fall in distinct banks.
fn dq_stage_pitch(n: usize) -> usize {
    8 * n + 8
}

/// The dQ accumulators of 8 columns each plane holds (its share of the
/// head dim `d`) in a cube of `planes` planes over blocks of `cols`
/// queries.
fn dq_accumulators(planes: usize, cols: usize, d: usize) -> usize {
    d / 8 / (planes / dq_query_planes(cols))
}

/// f32 of such a cube's dQ staging tiles: 32 rows per plane.
pub(crate) fn dq_stage_floats(planes: usize, cols: usize, d: usize) -> usize {
    planes * 32 * dq_stage_pitch(dq_accumulators(planes, cols, d))
}

/// Adds a plane's dQ accumulators (`mt = 2` tiles of 16 queries from
/// `row0` by `n` accumulators of 8 columns from `col0`) into the f32
/// accumulator, rows from `row_base`. The plane stages its tile in
/// `smem_dq` (its own `32·dq_stage_pitch(n)` f32 from `32·plane` rows),
/// then every lane adds whole 16-byte runs of rows: each atomic
/// instruction of the plane covers whole rows of the tile (whole 128-byte
/// lines at `n = 4`), from one base address plus constant offsets.
#[cube]
#[allow(clippy::too_many_arguments)]
fn add_dq(
    acc: &Sequence<Frag<f32>>,
    smem_dq: &mut SharedMemory<Quad>,
    dq_acc: &mut Tensor<Atomic<Quad>>,
    row_base: usize,
    row0: usize,
    col0: usize,
    seq_q: usize,
    #[comptime] n: usize,
    #[comptime] d: usize,
) {
    let pitch = comptime![dq_stage_pitch(n)];
    let lane = UNIT_POS_PLANE as usize;
    let tile0 = (UNIT_POS as usize / 32) * comptime![32 * pitch / 4];
    {
        let mut pairs = smem_dq.to_slice_mut().with_vector_size::<Const<2>>();
        let top = tile0 * 2 + (lane / 4) * comptime![pitch / 2] + lane % 4;
        #[unroll]
        for m in 0..2usize {
            #[unroll]
            for j in 0..n {
                let a = acc.index(m * n + j);
                pairs[top + comptime![m * 16 * pitch / 2 + j * 4]] = a[0usize];
                pairs[top + comptime![(m * 16 + 8) * pitch / 2 + j * 4]] = a[1usize];
            }
        }
    }
    sync_plane();
    // `2n` quads per row, `16 / n` rows per round of the plane.
    let per_row = comptime![2 * n];
    let step = comptime![32 / (2 * n)];
    let r = lane / per_row;
    let c = lane % per_row;
    let from = tile0 + r * comptime![pitch / 4] + c;
    let to = ((row_base + row0 + r) * d + col0) / 4 + c;
    if row0 + 32 <= seq_q {
        #[unroll]
        for it in 0..comptime![32 / step] {
            let quad = smem_dq[from + comptime![it * step * pitch / 4]];
            dq_acc[to + comptime![it * step * d / 4]].fetch_add(quad);
        }
    } else {
        #[unroll]
        for it in 0..comptime![32 / step] {
            if row0 + r + it * step < seq_q {
                let quad = smem_dq[from + comptime![it * step * pitch / 4]];
                dq_acc[to + comptime![it * step * d / 4]].fetch_add(quad);
            }
        }
    }
}

#[cube(launch_unchecked, fast_math = FastMath::all())]
pub(crate) fn mma_fused_backward_kernel<F: Float, N: Size>(
    inputs: &KeySideInputs<F, N>,
    dk: &mut Tensor<Vector<F, N>>,
    dv: &mut Tensor<Vector<F, N>>,
    dq_acc: &mut Tensor<Atomic<Quad>>,
    dims: AttnDims,
    #[comptime] t: AttnTile,
    #[define(F)] _dtype: StorageType,
) {
    // Phase 1: 32 keys by `cols / 2` queries per plane.
    let sn = comptime![t.cols as usize / 16];
    // Phase 2: 32 keys by `d / 2` columns per plane.
    let dn = comptime![t.head_dim as usize / 16];
    // Phase 3: 32 queries by `d / dq_split` columns per plane.
    let dq_rows = comptime![dq_query_planes(t.cols as usize)];
    let dq_split = comptime![t.rows as usize / 16 / dq_rows];
    let d = comptime![t.head_dim as usize];
    let qn = comptime![dq_accumulators(t.rows as usize / 16, t.cols as usize, d)];
    // 32-lane planes: the launcher runs these kernels only there.
    let lane = UNIT_POS_PLANE as usize;
    let plane = UNIT_POS as usize / 32;
    let rows = comptime![t.rows as usize];
    let cols = comptime![t.cols as usize];
    let pitch = comptime![t.head_dim as usize / 8 + 1];
    let ksteps = comptime![t.head_dim as usize / 16];
    // `Pᵀ` and `dSᵀ` tiles: keys by queries.
    let p_pitch = comptime![t.cols as usize / 8 + 1];
    let own = owned_rows(&dims, &inputs.key_lengths, &inputs.doc_starts, false, t);
    if own.b < dims.batch {
        let k0 = own.first;
        let mut smem_k =
            SharedMemory::<Vector<F, N>>::new_aligned(comptime![rows * pitch], 16usize);
        let mut smem_v =
            SharedMemory::<Vector<F, N>>::new_aligned(comptime![rows * pitch], 16usize);
        let mut smem_p =
            SharedMemory::<Vector<F, N>>::new_aligned(comptime![rows * p_pitch], 16usize);
        let mut smem_ds =
            SharedMemory::<Vector<F, N>>::new_aligned(comptime![rows * p_pitch], 16usize);
        let mut smem_dq = SharedMemory::<Quad>::new_aligned(
            comptime![dq_stage_floats(t.rows as usize / 16, t.cols as usize, d) / 4],
            16usize,
        );
        load_keys_values::<F, N>(inputs, &own, dims.seq_k, &mut smem_k, &mut smem_v, t);

        // Phase 1 and 2 tiles: 32 keys from `krow`; phase 1 takes query
        // half `plane % 2`, phase 2 head-dim half `plane % 2`.
        let krow = (plane / 2) * 32;
        let half_q = (plane % 2) * (cols / 2);
        let half_d = (plane % 2) * (d / 2);
        let key_top = k0 + krow + lane / 4;
        let key_ends = lane_key_ends::<F, N>(inputs, &own, &dims, key_top, 2usize, t);
        // Phase 3 tile: 32 queries from `qrow`, columns from `dcol`.
        let qrow = (plane % dq_rows) * 32;
        let dcol = (plane / dq_rows) * (d / dq_split);
        let mut acc_k = zero_accs(2 * dn);
        let mut acc_v = zero_accs(2 * dn);

        // Every (query head of the group, query block) in one sequence.
        // Waiting for a block is also the barrier after which the
        // previous block's `Pᵀ` and `dSᵀ` tiles are free.
        let mut queries = QueryStream::<F, N>::start(inputs, &own, &dims, t);
        for i in 0..queries.count {
            let first = queries.wait(inputs, &own, &dims, i, t);
            let h = queries.head(&own, &dims, i);
            let q0 = queries.first_query(&own, i, t);
            let q = queries.q;
            let dout = queries.dout;

            // Phase 1.
            let q_half = first + half_q;
            let mut p = products::<F, N>(&smem_k, krow, &q, q_half, 2usize, sn, ksteps, pitch);
            let mut ds = products::<F, N>(&smem_v, krow, &dout, q_half, 2usize, sn, ksteps, pitch);
            // Keys past the sequence (zero rows of the tiles) count as
            // outside the block, so the mask zeroes their probabilities
            // and no overflow of theirs reaches dQ.
            let full = queries_full(&own, &dims, q0, k0 + rows - 1, t);
            let stats = queries.stat;
            softmax_grads(
                &mut p, &mut ds, &stats, first, half_q, q0, key_top, &key_ends, full, &own, &dims,
                2usize, sn, t,
            );
            #[unroll]
            for m in 0..2usize {
                let r = krow + m * 16;
                let at = comptime![m * sn];
                stage_accs::<F, N>(&p, &mut smem_p, r, half_q, 1.0f32, 1.0f32, at, sn, p_pitch);
                stage_accs::<F, N>(
                    &ds,
                    &mut smem_ds,
                    r,
                    half_q,
                    1.0f32,
                    1.0f32,
                    at,
                    sn,
                    p_pitch,
                );
            }
            sync_cube();

            // Phase 2.
            let qsteps = comptime![t.cols as usize / 16];
            accumulate_tiles::<F, N>(
                &mut acc_v, &smem_p, krow, &dout, first, half_d, false, p_pitch, pitch, 2usize, dn,
                qsteps,
            );
            accumulate_tiles::<F, N>(
                &mut acc_k, &smem_ds, krow, &q, first, half_d, false, p_pitch, pitch, 2usize, dn,
                qsteps,
            );

            // Phase 3.
            let mut acc_q = zero_accs(2 * qn);
            let ksteps_q = comptime![t.rows as usize / 16];
            accumulate_tiles::<F, N>(
                &mut acc_q, &smem_ds, qrow, &smem_k, 0usize, dcol, true, p_pitch, pitch, 2usize,
                qn, ksteps_q,
            );
            let row_base = (own.b * dims.heads + h) * dims.seq_q;
            let dq_row = q0 + qrow;
            add_dq(
                &acc_q,
                &mut smem_dq,
                dq_acc,
                row_base,
                dq_row,
                dcol,
                dims.seq_q,
                qn,
                d,
            );
        }

        // The key and value tiles take the results once every plane is
        // done reading the key tile; each plane then stores 16 rows.
        sync_cube();
        let scale = dims.scale;
        #[unroll]
        for m in 0..2usize {
            let r = krow + m * 16;
            let at = comptime![m * dn];
            stage_accs::<F, N>(&acc_k, &mut smem_k, r, half_d, scale, scale, at, dn, pitch);
            stage_accs::<F, N>(
                &acc_v,
                &mut smem_v,
                r,
                half_d,
                1.0f32,
                1.0f32,
                at,
                dn,
                pitch,
            );
        }
        sync_cube();
        let row0 = plane * 16;
        store_dk_dv::<F, N>(&smem_k, &smem_v, dk, dv, inputs, &own, row0, dims.seq_k, t);
    }
}
