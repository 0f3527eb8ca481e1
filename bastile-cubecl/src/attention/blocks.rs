//! The row kernels of the matrix-product attention path.
//!
//! That path computes attention one block of query rows at a time with
//! ordinary matrix products (cuBLASLt on CUDA, so the products run on
//! tensor cores): `S = Q_blk·K_rangeᵀ` in f32, a row kernel turning `S`
//! into probabilities, `O_blk = P·V_range`; and backward `dP = dO_blk·V_rangeᵀ`,
//! a row kernel forming `P` again and `dS`, then `dQ_blk = dS·K_range`,
//! `dK_range += dSᵀ·Q_blk`, `dV_range += Pᵀ·dO_blk`. Only one block of
//! scores exists at a time, so memory stays linear in the sequence length;
//! the forward saves the same `o` and `lse` as the tiled kernels, so the
//! two paths are interchangeable between forward and backward.
//!
//! A block holds query rows `[q0, q0 + rows)` of every batch entry and head
//! and the keys `[k_lo, k_lo + keys)` any of them can see; the matrices are
//! dense `[batch, heads, rows, keys]`. These kernels apply the masks
//! (key lengths, causal, sliding window, documents) and the sinks exactly
//! as the tiled kernels do: one cube per score row, `units` units striding
//! over it.

use cubecl::prelude::*;
use cubecl::server::Handle;

use super::tile::{AttnTile, MASKED, MASKED_BELOW, allowed, first_key, key_count};
use super::{AttentionProblem, flat_arg};
use crate::reduce::{RowReduce, cube_row_sum, row_max, row_sum};
use crate::{KernelError, launch};

/// One block of query rows and the key range they see.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueryBlock {
    /// The first query row.
    pub q0: usize,
    /// How many query rows (per batch entry and head).
    pub rows: usize,
    /// The first key any row of the block can see.
    pub k_lo: usize,
    /// How many keys from `k_lo` on.
    pub keys: usize,
}

impl QueryBlock {
    /// Splits the queries of `problem` into blocks of at most `rows` rows,
    /// each with the smallest key range its masks allow (causal blocks see
    /// only the keys up to their last row, windowed ones only those within
    /// the window of their first row; documents lie in device memory, so
    /// their bounds narrow nothing here and the row kernels mask the keys
    /// of other documents). Never an empty key range: a block
    /// whose rows see no key keeps one, masked, so the products stay
    /// well-formed.
    pub fn split(problem: &AttentionProblem, rows: usize) -> Vec<QueryBlock> {
        let p = problem;
        let rows = rows.max(1);
        // Query i sits at key position i + offset (bottom-right aligned);
        // the masks that use it need seq_k >= seq_q (validated).
        let offset = p.seq_k.saturating_sub(p.seq_q);
        (0..p.seq_q)
            .step_by(rows)
            .map(|q0| {
                let n = rows.min(p.seq_q - q0);
                let k_hi = if p.causal {
                    (q0 + n + offset).min(p.seq_k)
                } else {
                    p.seq_k
                };
                let k_lo = match p.window {
                    Some(w) => (q0 + offset + 1).saturating_sub(w),
                    None => 0,
                }
                .min(p.seq_k - 1);
                QueryBlock {
                    q0,
                    rows: n,
                    k_lo,
                    keys: k_hi.saturating_sub(k_lo).max(1),
                }
            })
            .collect()
    }

    /// The block lies within the problem's queries and keys.
    fn check(&self, p: &AttentionProblem) -> Result<(), KernelError> {
        if self.rows == 0
            || self.keys == 0
            || self.q0 + self.rows > p.seq_q
            || self.k_lo + self.keys > p.seq_k
        {
            return Err(KernelError::Shape(format!(
                "{self:?} does not lie within {} queries and {} keys",
                p.seq_q, p.seq_k
            )));
        }
        Ok(())
    }

    /// What both row kernels share: a valid problem, the block within it,
    /// the masks it names (`(sinks, key lengths, document starts)`), the
    /// f32 scores and the probabilities (of the dtype) of every score row
    /// and the f32 log-sum-exp of every query row. The scores' count.
    fn check_buffers(
        &self,
        p: &AttentionProblem,
        (sinks, key_lengths, doc_starts): (Option<&Handle>, Option<&Handle>, Option<&Handle>),
        scores: &Handle,
        probs: &Handle,
        lse: &Handle,
    ) -> Result<usize, KernelError> {
        p.validate()?;
        p.check_masks(sinks, key_lengths, doc_starts)?;
        self.check(p)?;
        let elements = self.score_rows(p) * self.keys;
        launch::check_holds("attention block scores", scores, elements, 4)?;
        let size = p.dtype.size();
        launch::check_holds("attention block probabilities", probs, elements, size)?;
        launch::check_holds("attention lse", lse, p.query_rows(), 4)?;
        Ok(elements)
    }

    fn score_rows(&self, problem: &AttentionProblem) -> usize {
        problem.batch * problem.heads * self.rows
    }
}

/// The buffers of the forward row kernel.
#[derive(Clone, Debug)]
pub struct BlockSoftmaxBuffers {
    /// f32 `[batch, heads, rows, keys]`: the unscaled products `q·k`.
    pub scores: Handle,
    /// Input dtype, `[batch, heads, rows, keys]`: the probabilities.
    pub probs: Handle,
    /// f32 `[batch, heads, seq_q]`: this block's rows are written.
    pub lse: Handle,
    pub sinks: Option<Handle>,
    pub key_lengths: Option<Handle>,
    pub doc_starts: Option<Handle>,
}

/// The buffers of the backward row kernel.
#[derive(Clone, Debug)]
pub struct BlockGradBuffers {
    /// f32 `[batch, heads, rows, keys]`: the recomputed products `q·k`.
    pub scores: Handle,
    /// f32 `[batch, heads, rows, keys]`: `dO·vᵀ`.
    pub dprobs: Handle,
    /// f32 `[batch, heads, seq_q]`: the forward's log-sum-exp and `Δ`.
    pub lse: Handle,
    pub delta: Handle,
    pub key_lengths: Option<Handle>,
    pub doc_starts: Option<Handle>,
    /// Input dtype, `[batch, heads, rows, keys]`: `P` and `dS` (the score
    /// gradient, the softmax scale included).
    pub probs: Handle,
    pub dscores: Handle,
}

/// Comptime layout of the row kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockRows {
    pub units: u32,
    pub slots: u32,
    pub reduce: RowReduce,
}

/// The problem's and the block's scalars as the row kernels take them.
#[derive(CubeType, CubeLaunch, Clone, Copy)]
pub(crate) struct BlockDims {
    /// Score rows of the block: `batch · heads · rows`.
    pub total_rows: usize,
    pub heads: usize,
    /// The block's query rows per batch entry and head, from `q0`.
    pub rows: usize,
    pub q0: usize,
    /// The block's keys, from `k_lo`.
    pub k_lo: usize,
    pub keys: usize,
    pub seq_q: usize,
    pub seq_k: usize,
    /// The sliding window, 0 without one.
    pub window: usize,
    pub scale: f32,
}

impl QueryBlock {
    fn dims_arg<R: Runtime>(&self, p: &AttentionProblem) -> BlockDimsLaunch<R> {
        BlockDimsLaunch::new(
            self.score_rows(p),
            p.heads,
            self.rows,
            self.q0,
            self.k_lo,
            self.keys,
            p.seq_q,
            p.seq_k,
            p.window.unwrap_or(0),
            p.scale,
        )
    }
}

/// Where a score row of the block sits: its row in the `[batch, heads,
/// seq_q]` statistics, its query position in the keys' frame, the first
/// key it sees (window, document) and the number of real keys of its
/// batch entry.
#[cube]
fn row_place(
    row: usize,
    key_lengths: &Tensor<i32>,
    doc_starts: &Tensor<i32>,
    dims: &BlockDims,
    #[comptime] t: AttnTile,
) -> (usize, usize, usize, usize) {
    let (rows, heads, seq_q, seq_k) = (dims.rows, dims.heads, dims.seq_q, dims.seq_k);
    let i = row % rows;
    let h = row / rows % heads;
    let b = row / rows / heads;
    let stat = (b * heads + h) * seq_q + dims.q0 + i;
    // Only the causal and window masks read it, and those need
    // seq_k >= seq_q; otherwise it must merely not underflow.
    let qpos = dims.q0 + i + seq_k - select(seq_k >= seq_q, seq_q, seq_k);
    let klen = key_count(key_lengths, b, seq_k, t);
    let lowest = first_key(doc_starts, b, qpos, seq_k, dims.window, t);
    (stat, qpos, lowest, klen)
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn block_softmax_kernel<F: Float>(
    scores: &Tensor<f32>,
    probs: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    sinks: &Tensor<f32>,
    key_lengths: &Tensor<i32>,
    doc_starts: &Tensor<i32>,
    dims: BlockDims,
    #[comptime] t: AttnTile,
    #[comptime] cfg: BlockRows,
    #[define(F)] _dtype: StorageType,
) {
    let row = CUBE_POS;
    let valid = row < dims.total_rows;
    let safe_row = select(valid, row, 0usize);
    let (stat, qpos, lowest, klen) = row_place(safe_row, key_lengths, doc_starts, &dims, t);
    let (keys, k_lo, scale) = (dims.keys, dims.k_lo, dims.scale);
    let base = safe_row * keys;
    let units = cfg.units as usize;
    let mut scratch = SharedMemory::<f32>::new(cfg.slots as usize);

    // Online maximum and rescaled exponential sum of this unit's keys.
    let mut m = comptime![MASKED].runtime();
    let mut l = 0.0f32;
    let mut j = UNIT_POS_X as usize;
    while valid && j < keys {
        if allowed(qpos, k_lo + j, lowest, klen, t) {
            let s = scores[base + j] * scale;
            let m_new = f32::max(m, s);
            l = l * f32::exp(m - m_new) + f32::exp(s - m_new);
            m = m_new;
        }
        j += units;
    }
    let mut row_m = row_max(m, &mut scratch, cfg.units, cfg.slots, cfg.reduce);
    let mut sink = comptime![MASKED].runtime();
    if comptime![t.sinks] {
        sink = sinks[select(valid, row / dims.rows % dims.heads, 0usize)];
        row_m = f32::max(row_m, sink);
    }
    // exp(MASKED − MASKED) = 1 times l = 0 for a unit that saw no key.
    let mut row_l = row_sum(
        l * f32::exp(m - row_m),
        &mut scratch,
        cfg.units,
        cfg.slots,
        cfg.reduce,
    );
    if comptime![t.sinks] {
        row_l += f32::exp(sink - row_m);
    }
    let row_lse = select(row_l > 0.0f32, row_m + f32::ln(row_l), MASKED);
    if valid && UNIT_POS_X == 0 {
        lse[stat] = row_lse;
    }
    let mut j = UNIT_POS_X as usize;
    while valid && j < keys {
        let mut p = 0.0f32;
        if allowed(qpos, k_lo + j, lowest, klen, t) && row_lse > MASKED_BELOW {
            p = f32::exp(scores[base + j] * scale - row_lse);
        }
        probs[base + j] = F::cast_from(p);
        j += units;
    }
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn block_grad_kernel<F: Float>(
    scores: &Tensor<f32>,
    dprobs: &Tensor<f32>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    key_lengths: &Tensor<i32>,
    doc_starts: &Tensor<i32>,
    probs: &mut Tensor<F>,
    dscores: &mut Tensor<F>,
    dims: BlockDims,
    #[comptime] t: AttnTile,
    #[comptime] cfg: BlockRows,
    #[define(F)] _dtype: StorageType,
) {
    let row = CUBE_POS;
    if row < dims.total_rows {
        let (stat, qpos, lowest, klen) = row_place(row, key_lengths, doc_starts, &dims, t);
        let (keys, k_lo, scale) = (dims.keys, dims.k_lo, dims.scale);
        let row_lse = lse[stat];
        let row_delta = delta[stat];
        let base = row * keys;
        let mut j = UNIT_POS_X as usize;
        while j < keys {
            let mut p = 0.0f32;
            if allowed(qpos, k_lo + j, lowest, klen, t) && row_lse > MASKED_BELOW {
                p = f32::exp(scores[base + j] * scale - row_lse);
            }
            probs[base + j] = F::cast_from(p);
            dscores[base + j] = F::cast_from(p * (dprobs[base + j] - row_delta) * scale);
            j += comptime![cfg.units as usize];
        }
    }
}

/// The row layout for `problem` on this client: 256 units per row (fewer
/// where the device allows fewer), combined by plane shuffles where the
/// runtime has them.
fn layout<R: Runtime>(client: &ComputeClient<R>) -> Result<BlockRows, KernelError> {
    let max_units = client.properties().hardware.max_units_per_cube.max(1);
    let units = 256u32.min(1 << (31 - max_units.leading_zeros()));
    let sum = cube_row_sum(client, units)?;
    Ok(BlockRows {
        units,
        slots: sum.slots,
        reduce: sum.reduce,
    })
}

/// The comptime mask flags of `problem` (the row kernels use only those
/// fields of the tile).
fn mask_tile(problem: &AttentionProblem, units: u32) -> AttnTile {
    AttnTile {
        rows: 1,
        cols: 1,
        upr: units,
        head_dim: problem.head_dim as u32,
        pitch: problem.head_dim as u32,
        causal: problem.causal,
        window: problem.window.is_some(),
        sinks: problem.sinks,
        key_lengths: problem.key_lengths,
        documents: problem.documents,
    }
}

/// Turns one block's products into probabilities and writes its rows of
/// the log-sum-exp.
pub fn block_softmax<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &AttentionProblem,
    block: &QueryBlock,
    buffers: &BlockSoftmaxBuffers,
) -> Result<(), KernelError> {
    let b = buffers;
    let masks = (
        b.sinks.as_ref(),
        b.key_lengths.as_ref(),
        b.doc_starts.as_ref(),
    );
    let elements = block.check_buffers(problem, masks, &b.scores, &b.probs, &b.lse)?;
    let cfg = layout(client)?;
    let p = problem;
    let total = block.score_rows(p);
    let dummy = || client.empty(4);
    let sinks = buffers.sinks.clone().unwrap_or_else(dummy);
    let lengths = buffers.key_lengths.clone().unwrap_or_else(dummy);
    let starts = buffers.doc_starts.clone().unwrap_or_else(dummy);
    unsafe {
        block_softmax_kernel::launch_unchecked::<R>(
            client,
            launch::cube_count(client, total)?,
            CubeDim::new_1d(cfg.units),
            flat_arg(&buffers.scores, elements),
            flat_arg(&buffers.probs, elements),
            flat_arg(&buffers.lse, p.query_rows()),
            flat_arg(&sinks, if p.sinks { p.heads } else { 1 }),
            flat_arg(&lengths, if p.key_lengths { p.batch } else { 1 }),
            p.doc_starts_arg(&starts),
            block.dims_arg::<R>(p),
            mask_tile(p, cfg.units),
            cfg,
            p.dtype.storage(),
        )
    }
    Ok(())
}

/// Forms one block's probabilities again and the score gradient
/// `dS = P ⊙ (dP − Δ) · scale`.
pub fn block_grad<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &AttentionProblem,
    block: &QueryBlock,
    buffers: &BlockGradBuffers,
) -> Result<(), KernelError> {
    let b = buffers;
    // This kernel reads no sinks.
    let reads = AttentionProblem {
        sinks: false,
        ..*problem
    };
    let masks = (None, b.key_lengths.as_ref(), b.doc_starts.as_ref());
    let elements = block.check_buffers(&reads, masks, &b.scores, &b.probs, &b.lse)?;
    let cfg = layout(client)?;
    let p = problem;
    let total = block.score_rows(p);
    launch::check_holds(
        "attention block probability gradients",
        &b.dprobs,
        elements,
        4,
    )?;
    launch::check_holds("attention delta", &b.delta, p.query_rows(), 4)?;
    launch::check_holds(
        "attention block score gradients",
        &b.dscores,
        elements,
        p.dtype.size(),
    )?;
    let dummy = || client.empty(4);
    let lengths = buffers.key_lengths.clone().unwrap_or_else(dummy);
    let starts = buffers.doc_starts.clone().unwrap_or_else(dummy);
    unsafe {
        block_grad_kernel::launch_unchecked::<R>(
            client,
            launch::cube_count(client, total)?,
            CubeDim::new_1d(cfg.units),
            flat_arg(&buffers.scores, elements),
            flat_arg(&buffers.dprobs, elements),
            flat_arg(&buffers.lse, p.query_rows()),
            flat_arg(&buffers.delta, p.query_rows()),
            flat_arg(&lengths, if p.key_lengths { p.batch } else { 1 }),
            p.doc_starts_arg(&starts),
            flat_arg(&buffers.probs, elements),
            flat_arg(&buffers.dscores, elements),
            block.dims_arg::<R>(p),
            mask_tile(p, cfg.units),
            cfg,
            p.dtype.storage(),
        )
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FloatDtype;

    fn problem(
        seq_q: usize,
        seq_k: usize,
        causal: bool,
        window: Option<usize>,
    ) -> AttentionProblem {
        AttentionProblem {
            batch: 1,
            heads: 2,
            kv_heads: 1,
            seq_q,
            seq_k,
            head_dim: 8,
            scale: 1.0,
            causal,
            window,
            sinks: false,
            key_lengths: false,
            documents: false,
            dtype: FloatDtype::F32,
        }
    }

    fn ranges(blocks: &[QueryBlock]) -> Vec<(usize, usize, usize, usize)> {
        blocks
            .iter()
            .map(|b| (b.q0, b.rows, b.k_lo, b.keys))
            .collect()
    }

    #[test]
    fn blocks_cover_the_queries_and_only_the_visible_keys() {
        // No mask: every block sees every key; the last block is short.
        let b = QueryBlock::split(&problem(10, 7, false, None), 4);
        assert_eq!(ranges(&b), [(0, 4, 0, 7), (4, 4, 0, 7), (8, 2, 0, 7)]);
        // Causal with two more keys than queries: query i sits at key i + 2
        // and the block sees keys up to its last row's position.
        let b = QueryBlock::split(&problem(6, 8, true, None), 4);
        assert_eq!(ranges(&b), [(0, 4, 0, 6), (4, 2, 0, 8)]);
        // A window of 3: the block starting at query 4 sees keys 2..=5.
        let b = QueryBlock::split(&problem(6, 6, true, Some(3)), 4);
        assert_eq!(ranges(&b), [(0, 4, 0, 4), (4, 2, 2, 4)]);
    }
}
