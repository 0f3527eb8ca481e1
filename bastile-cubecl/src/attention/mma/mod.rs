//! The tensor-core attention path: the same forward and backward as the
//! tiled kernels (same `o`, `lse`, `Δ` and masks, so either path's
//! forward pairs with either's backward), with every product on the
//! tensor cores (`mma.sync` `m16n8k16`, f16/bf16 inputs, f32
//! accumulation) and the scores, probabilities and accumulators kept in
//! registers. A cube is `planes` planes of 32 lanes, each owning 16 rows;
//! the other side streams past in blocks of `cols` rows.
//!
//! It runs where the runtime offers that instruction with the register
//! layout the kernels are written for (CUDA, sm_80 and newer), for f16
//! and bf16, head dims that are multiples of 16 (up to 256), and tensors
//! whose strides and offsets allow 16-byte loads; [`usable`] says whether
//! a problem qualifies.

mod backward;
mod dq_sum;
mod forward;
mod fragment;
mod fused_backward;
mod stream;

use cubecl::ir::features::AtomicUsage;
use cubecl::ir::{ElemType, FloatKind, StorageType, Type};
use cubecl::prelude::*;
use cubecl::tune::{LocalTuner, local_tuner};

use super::tile::{AttnTile, OwnedRows, allowed, seen_by};
use super::{
    AttentionBackwardBuffers, AttentionForwardBuffers, AttentionProblem, AttnDims, AttnKey,
    HeadLayout, backward_delta_zeroing, flat_arg, half_rows_in_vectors, key,
};
use crate::tune::{CandidateCache, Tuner, run_tuned};
use crate::{FloatDtype, KernelError, launch};

/// Elements per 16-byte vector of f16/bf16: the kernels' unit of
/// global and shared memory traffic.
const VEC: usize = 8;

/// One launch configuration: `planes` planes of `16·tiles` rows each own
/// the cube's rows; the other side streams in blocks of `cols` rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct MmaLaunch {
    pub planes: u32,
    pub cols: u32,
    /// Forward only, 1 or 2: the 16-row tiles each plane owns. Two tiles
    /// share every key and value fragment a plane reads (a third fewer
    /// shared-memory reads per product, twice the independent products)
    /// and read their queries from shared memory each block, leaving the
    /// registers to the doubled scores and outputs.
    pub tiles: u32,
    /// Backward only: one fused kernel forms dK, dV and dQ (the last added
    /// into an f32 accumulator with atomics: five products per block pair,
    /// the last bits of dQ varying from run to run), its planes in tiles of
    /// 32 rows, instead of the dK/dV kernel followed by the dQ kernel
    /// (seven products, deterministic).
    pub fused_dq: bool,
}

impl MmaLaunch {
    fn rows(&self) -> usize {
        16 * (self.planes * self.tiles) as usize
    }

    fn tile(&self, problem: &AttentionProblem) -> AttnTile {
        AttnTile {
            rows: self.rows() as u32,
            cols: self.cols,
            // Units per 16 rows of the tile: one plane over its `tiles`.
            upr: 32 / self.tiles,
            head_dim: problem.head_dim as u32,
            pitch: (problem.head_dim / VEC + 1) as u32,
            causal: problem.causal,
            window: problem.window.is_some(),
            sinks: problem.sinks,
            key_lengths: problem.key_lengths,
            documents: problem.documents,
        }
    }

    /// Shared memory of the forward or of the larger backward kernel: padded
    /// tiles of 16-byte vectors (and the backward's per-query statistics).
    fn shared_bytes(&self, problem: &AttentionProblem, backward: bool) -> usize {
        let row = (problem.head_dim / VEC + 1) * 16;
        let (rows, cols) = (self.rows(), self.cols as usize);
        if backward {
            // Keys and values, two stages of queries and output gradients
            // with their statistics, and in the fused kernel the `Pᵀ` and
            // `dSᵀ` tiles.
            let dkdv = 2 * (rows + 2 * cols) * row + 4 * cols * 4;
            if self.fused_dq {
                // ... and each plane's dQ staging tile of 32 rows.
                let staging =
                    fused_backward::dq_stage_floats(self.planes as usize, cols, problem.head_dim)
                        * 4;
                dkdv + 2 * rows * (cols / VEC + 1) * 16 + staging
            } else {
                // The dQ kernel: two stages of `2·cols` keys and values.
                dkdv.max((2 * rows + 8 * cols) * row)
            }
        } else {
            // Two stages of keys and values.
            (rows + 4 * cols) * row
        }
    }

    fn check<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        problem: &AttentionProblem,
        backward: bool,
    ) -> Result<AttnTile, KernelError> {
        if self.planes == 0 || self.cols == 0 || !self.cols.is_multiple_of(16) {
            return Err(KernelError::Unsupported(format!(
                "{self:?}: blocks must be whole 16-row fragments"
            )));
        }
        if !(self.tiles == 1 || self.tiles == 2 && !backward) {
            return Err(KernelError::Unsupported(format!(
                "{self:?}: planes own one 16-row tile, or two in the forward"
            )));
        }
        if self.fused_dq {
            self.check_fused(client, problem, backward)?;
        }
        launch::check_cube_fits(
            client,
            32 * self.planes,
            self.shared_bytes(problem, backward),
        )?;
        Ok(self.tile(problem))
    }

    /// The fused backward's tiling: planes in pairs over 32-key tiles,
    /// query blocks of whole 32-query dQ tiles, and a head dim that splits
    /// in halves (dK/dV) and across the dQ planes in 16 columns; its
    /// two 32-by-`d/2` accumulators per plane fit the registers up to a
    /// head dim of 128. It adds into dQ four f32 at a time.
    fn check_fused<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        problem: &AttentionProblem,
        backward: bool,
    ) -> Result<(), KernelError> {
        let (planes, cols, d) = (self.planes as usize, self.cols as usize, problem.head_dim);
        let dq_rows = fused_backward::dq_query_planes(cols);
        let tiles = planes.is_multiple_of(2)
            && cols.is_multiple_of(32)
            && planes.is_multiple_of(dq_rows)
            && d <= 128
            && d.is_multiple_of(32)
            && d.is_multiple_of(16 * (planes / dq_rows));
        if !backward || !atomic_quads(client) || !tiles {
            return Err(KernelError::Unsupported(format!(
                "{self:?}: the fused backward needs atomic additions of four f32, an even \
                 number of planes, query blocks of whole 32-row tiles and a head dim (here {d}) \
                 of at most 128 that its planes split in 16-column slices"
            )));
        }
        Ok(())
    }
}

/// Whether this client runs the tensor-core kernels in `dtype` at all:
/// CUDA with 32-lane planes, `m16n8k16` products of `dtype` into f32 and
/// `ldmatrix` loads of it.
pub fn available<R: Runtime>(client: &ComputeClient<R>, dtype: FloatDtype) -> bool {
    let props = client.properties();
    let hw = &props.hardware;
    if dtype == FloatDtype::F32 {
        return false;
    }
    let elem = dtype.storage();
    let f32_elem = FloatDtype::F32.storage();
    let mma = props.features.matmul.mma.iter().any(|c| {
        c.a_type == elem
            && c.b_type == elem
            && c.cd_type == f32_elem
            && (c.m, c.n, c.k) == (16, 8, 16)
    });
    R::name(client) == "cuda"
        && mma
        && props.features.matmul.ldmatrix.contains(&elem)
        && hw.plane_size_min == 32
        && hw.plane_size_max == 32
}

/// Whether the device adds vectors of four f32 atomically (sm_90 and
/// newer), what the fused dQ accumulates with.
fn atomic_quads<R: Runtime>(client: &ComputeClient<R>) -> bool {
    let quad = Type::new(StorageType::Atomic(ElemType::Float(FloatKind::F32))).with_vector_size(4);
    client
        .properties()
        .atomic_type_usage(quad)
        .contains(AtomicUsage::Add)
}

/// Whether `problem` can run on the tensor-core path on this client (its
/// buffers are checked at launch; see the module docs).
pub fn usable<R: Runtime>(client: &ComputeClient<R>, problem: &AttentionProblem) -> bool {
    problem.validate().is_ok()
        && available(client, problem.dtype)
        && problem.head_dim.is_multiple_of(16)
        && problem.head_dim <= 256
}

fn ready<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &AttentionProblem,
    layouts: &[&HeadLayout],
) -> Result<(), KernelError> {
    problem.validate()?;
    if !usable(client, problem) {
        return Err(KernelError::Unsupported(format!(
            "the tensor-core attention does not run {problem:?} on this device"
        )));
    }
    half_rows_in_vectors(layouts, "the tensor-core attention")
}

/// [`ready`] for a forward call, and its buffers fit `problem`.
fn forward_ready<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &AttentionProblem,
    buffers: &AttentionForwardBuffers,
) -> Result<(), KernelError> {
    ready(client, problem, &buffers.layouts())?;
    buffers.check(problem)
}

/// [`ready`] for a backward call, and its buffers fit `problem`.
fn backward_ready<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &AttentionProblem,
    buffers: &AttentionBackwardBuffers,
) -> Result<(), KernelError> {
    ready(client, problem, &buffers.layouts())?;
    buffers.check(problem, false)
}

/// Launches the forward with one explicit configuration.
pub fn forward_with<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &AttentionProblem,
    buffers: &AttentionForwardBuffers,
    config: &MmaLaunch,
) -> Result<(), KernelError> {
    forward_ready(client, problem, buffers)?;
    let b = buffers;
    let t = config.check(client, problem, false)?;
    let p = problem;
    let q_blocks = p.seq_q.div_ceil(config.rows());
    let count = launch::cube_count(client, p.batch * p.heads * q_blocks)?;
    let cube_dim = CubeDim::new_1d(32 * config.planes);
    let inputs = b.inputs(client, p, VEC);
    let out = p.query_arg(&b.out);
    let lse = flat_arg(&b.lse, p.query_rows());
    let dims = p.dims_arg::<R>(q_blocks);
    let dtype = p.dtype.storage();
    unsafe {
        forward::mma_forward_kernel::launch_unchecked::<R>(
            client, count, cube_dim, VEC, inputs, out, lse, dims, t, dtype,
        )
    }
    Ok(())
}

/// Launches the backward with one explicit configuration: `Δ`, then
/// either the dK/dV kernel, which owns `16·planes` keys and streams `cols`
/// queries, and the dQ kernel, which owns `16·planes` queries and streams
/// `2·cols` keys (it holds one head-dim accumulator per lane where the
/// dK/dV kernel holds two, so it affords the wider blocks); or, with
/// `fused_dq`, the fused kernel between the zeroing and the rounding of
/// its f32 dQ accumulator.
pub fn backward_with<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &AttentionProblem,
    buffers: &AttentionBackwardBuffers,
    config: &MmaLaunch,
) -> Result<(), KernelError> {
    backward_ready(client, problem, buffers)?;
    let b = buffers;
    let t = config.check(client, problem, true)?;
    let p = problem;
    let rows = p.query_rows();
    // The fused dQ's f32 accumulator, dense `[batch, heads, seq_q, d]`,
    // zeroed by the Δ kernel as it walks the same rows.
    let dq_len = rows * p.head_dim;
    let dq_vecs = dq_len / VEC;
    let dq_acc = client.empty(if config.fused_dq {
        (dq_len * 4).max(16)
    } else {
        16
    });
    backward_delta_zeroing(client, problem, buffers, config.fused_dq.then_some(&dq_acc))?;
    let k_blocks = p.seq_k.div_ceil(config.rows());
    let k_count = launch::cube_count(client, p.batch * p.kv_heads * k_blocks)?;
    let cube_dim = CubeDim::new_1d(32 * config.planes);
    let dk = || p.key_arg(&b.dk);
    let dv = || p.key_arg(&b.dv);
    let dtype = p.dtype.storage();
    unsafe {
        if config.fused_dq {
            let inputs = b.inputs(client, p, VEC);
            let dq_sums = flat_arg(&dq_acc, dq_len);
            let dims = p.dims_arg::<R>(k_blocks);
            fused_backward::mma_fused_backward_kernel::launch_unchecked::<R>(
                client,
                k_count,
                cube_dim,
                VEC,
                inputs,
                dk(),
                dv(),
                dq_sums,
                dims,
                t,
                dtype,
            );
            let [s_b, s_h, s_q] = b.dq.strides.map(|s| s / VEC);
            dq_sum::round_dq_kernel::launch_unchecked::<R>(
                client,
                launch::cube_count(client, dq_vecs.div_ceil(256))?,
                CubeDim::new_1d(256),
                VEC,
                flat_arg(&dq_acc, dq_len),
                p.query_arg(&b.dq),
                s_b,
                s_h,
                s_q,
                p.heads,
                p.seq_q,
                dq_vecs,
                p.scale,
                p.head_dim / VEC,
                dtype,
            );
        } else {
            let inputs = b.inputs(client, p, VEC);
            let dims = p.dims_arg::<R>(k_blocks);
            backward::mma_dkdv_kernel::launch_unchecked::<R>(
                client,
                k_count,
                cube_dim,
                VEC,
                inputs,
                dk(),
                dv(),
                dims,
                t,
                dtype,
            );
            let q_blocks = p.seq_q.div_ceil(config.rows());
            let q_count = launch::cube_count(client, p.batch * p.heads * q_blocks)?;
            let t = AttnTile {
                cols: 2 * t.cols,
                ..t
            };
            let inputs = b.inputs(client, p, VEC);
            let dq = p.query_arg(&b.dq);
            let dims = p.dims_arg::<R>(q_blocks);
            backward::mma_dq_kernel::launch_unchecked::<R>(
                client, q_count, cube_dim, VEC, inputs, dq, dims, t, dtype,
            );
        }
    }
    Ok(())
}

/// Every configuration that fits `problem` on this device, for the forward
/// or the backward (the backward holds two accumulators of the head dim
/// per lane, so it streams narrower blocks).
pub fn candidates<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &AttentionProblem,
    backward: bool,
) -> Vec<MmaLaunch> {
    // (planes, cols, tiles, fused_dq). The first of each list is the
    // default (`tune::TunePolicy::Defaults`): the fastest on an H200 for
    // 16 / 8 heads of 128 at 4096 tokens, causal (backward 0.72 ms, the
    // next 0.80; forward 0.26 ms, where the one-tile 64-key planes that
    // came first before took 0.35).
    let shapes: &[(u32, u32, u32, bool)] = if backward {
        // Fused and separate forms alternate, so a rotation through the
        // list exercises both.
        &[
            (8, 64, 1, true),
            (8, 32, 1, false),
            (4, 64, 1, true),
            (4, 32, 1, false),
            (8, 32, 1, true),
            (8, 16, 1, false),
            (4, 32, 1, true),
            (4, 16, 1, false),
            (2, 32, 1, false),
        ]
    } else {
        // One- and two-tile planes alternate, for the same reason. Two
        // tiles by 64 keys outgrow the registers of a 255-register lane
        // (two tiles by 32 keys take about 250).
        &[
            (4, 32, 2, false),
            (4, 64, 1, false),
            (4, 32, 1, false),
            (2, 32, 2, false),
            (8, 64, 1, false),
            (4, 16, 2, false),
            (8, 32, 1, false),
            (8, 32, 2, false),
            (12, 64, 1, false),
            (8, 128, 1, false),
        ]
    };
    let mut shapes = shapes.to_vec();
    if problem.head_dim <= 64 {
        if backward {
            // Up to a head dim of 64, cubes of 4 planes come first: on an
            // H200, 32 / 8 heads of 64, causal, they took 0.86, 3.03 and
            // 11.8 ms at 4096, 8192 and 16384 tokens, 8 planes 0.89, 3.36
            // and 13.1 (the tuner's medians). Both are fused, so the forms
            // still alternate.
            shapes.swap(0, 2);
        } else {
            // The outputs take half the registers, so two tiles fit blocks
            // of 64 keys: 303, 990 and 3 735 µs against 323, 1 076 and
            // 3 947 for the default there.
            shapes.insert(0, (4, 64, 2, false));
        }
    }
    shapes
        .iter()
        .map(|&(planes, cols, tiles, fused_dq)| MmaLaunch {
            planes,
            cols,
            tiles,
            fused_dq,
        })
        .filter(|c| c.check(client, problem, backward).is_ok())
        .collect()
}

static FORWARD_TUNER: Tuner<AttnKey> = local_tuner!("bastile-attention-mma-forward");
static BACKWARD_TUNER: Tuner<AttnKey> = local_tuner!("bastile-attention-mma-backward");
static CANDIDATES: CandidateCache<(usize, FloatDtype, bool), MmaLaunch> = CandidateCache::new();

/// Forgets every tuning decision of this path taken in this process.
pub fn clear_autotune() {
    FORWARD_TUNER.clear();
    BACKWARD_TUNER.clear();
}

fn tuned_candidates<R: Runtime>(
    client: &ComputeClient<R>,
    device: &R::Device,
    problem: &AttentionProblem,
    backward: bool,
) -> (cubecl::CubeTuneId, AttnKey, std::sync::Arc<Vec<MmaLaunch>>) {
    let id = cubecl::CubeTuneId::new(client, device);
    let class = (problem.head_dim, problem.dtype, backward);
    let list = CANDIDATES.get(&id, class, || candidates(client, problem, backward));
    (id, key(problem, backward), list)
}

/// Runs the forward with the autotuned configuration.
pub fn forward<R: Runtime>(
    client: &ComputeClient<R>,
    device: &R::Device,
    problem: &AttentionProblem,
    buffers: &AttentionForwardBuffers,
) -> Result<(), KernelError> {
    forward_ready(client, problem, buffers)?;
    let (id, key, list) = tuned_candidates(client, device, problem, false);
    run_tuned(
        &FORWARD_TUNER,
        key,
        forward_with::<R>,
        client,
        &id,
        problem,
        buffers,
        list,
    )
}

/// Runs the backward with the autotuned configuration.
pub fn backward<R: Runtime>(
    client: &ComputeClient<R>,
    device: &R::Device,
    problem: &AttentionProblem,
    buffers: &AttentionBackwardBuffers,
) -> Result<(), KernelError> {
    backward_ready(client, problem, buffers)?;
    let (id, key, list) = tuned_candidates(client, device, problem, true);
    run_tuned(
        &BACKWARD_TUNER,
        key,
        backward_with::<R>,
        client,
        &id,
        problem,
        buffers,
        list,
    )
}

/// Runs the backward with the first configuration (the fastest on an H200
/// among them, see [`candidates`]) that writes every gradient from the
/// cube that owns it: the dK/dV kernel, then the dQ kernel, no atomic
/// additions, so the result is the same bits on every run.
pub fn backward_deterministic<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &AttentionProblem,
    buffers: &AttentionBackwardBuffers,
) -> Result<(), KernelError> {
    backward_ready(client, problem, buffers)?;
    match candidates(client, problem, true)
        .into_iter()
        .find(|c| !c.fused_dq)
    {
        Some(config) => backward_with(client, problem, buffers, &config),
        None => Err(KernelError::Unsupported(format!(
            "no tensor-core backward without atomics fits {problem:?} on this device"
        ))),
    }
}

/// The units of a tensor-core cube: `upr` (one plane over its tiles) per
/// 16 rows of the tile.
pub(crate) fn mma_units(t: AttnTile) -> usize {
    t.rows as usize / 16 * t.upr as usize
}

/// The 16-row tiles each plane of a tensor-core cube owns.
pub(crate) fn plane_tiles(t: AttnTile) -> usize {
    32 / t.upr as usize
}

/// Whether every query the cube owns sees every key of the block of
/// `t.cols` keys from `k0`: then the block needs no mask. The first query
/// sees the last key (a real key, not in its future) and the last query
/// sees the first key (not before its window or document); every other
/// pair lies between.
#[cube]
pub(crate) fn keys_full(own: &OwnedRows, k0: usize, #[comptime] t: AttnTile) -> bool {
    let q_first = own.first + own.offset;
    let q_last = own.last + own.offset;
    let k_last = k0 + comptime![t.cols as usize] - 1;
    allowed(q_first, k_last, own.first_bound, own.klen, t)
        && allowed(q_last, k0, own.last_bound, own.klen, t)
}

/// Whether every query of the block of `t.cols` queries from `q0` sees
/// every key of `[own.first, k_last]`: then the block needs no mask. Keys
/// past the cube's last one do not exist, so such a block is never full;
/// otherwise the corners decide, as in [`keys_full`].
#[cube]
pub(crate) fn queries_full(
    own: &OwnedRows,
    dims: &AttnDims,
    q0: usize,
    k_last: usize,
    #[comptime] t: AttnTile,
) -> bool {
    let q_end = q0 + comptime![t.cols as usize];
    let q_row_last = select(q_end < dims.seq_q, q_end, dims.seq_q) - 1;
    let q_first = q0 + own.offset;
    let q_last = q_row_last + own.offset;
    k_last <= own.last
        && seen_by(q_first, k_last, own.last_bound, own.klen, t)
        && seen_by(q_last, own.first, own.first_bound, own.klen, t)
}
