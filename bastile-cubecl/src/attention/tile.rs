//! What the attention kernels share: the comptime tile, the mask test,
//! where a head's rows lie, which rows a cube owns and which blocks of the
//! other side they see, and the cooperative load of a block of rows into
//! shared memory.

use cubecl::prelude::*;

use super::AttnDims;

/// A score that is masked out. Finite, so that `m − MASKED` never forms
/// `∞ − ∞`; entries at or below [`MASKED_BELOW`] are treated as absent.
pub(crate) const MASKED: f32 = -3.0e38;
/// Scores below this are masked entries (no real score is that small).
pub(crate) const MASKED_BELOW: f32 = -1.0e38;

/// The comptime shape of one launch. A cube owns `rows` rows (query rows
/// in the forward and dQ kernels, key rows in the dK/dV kernel) and streams
/// blocks of `cols` rows of the other side past them. `upr` units share a
/// row: unit `lane` of a row owns the score columns `lane + j·upr` and the
/// head-dim columns `lane + j·upr` of its accumulators, so row statistics
/// only ever combine `upr` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttnTile {
    pub rows: u32,
    pub cols: u32,
    pub upr: u32,
    pub head_dim: u32,
    /// Shared-memory row pitch in elements: the head dim plus padding, so
    /// that the units of one row reading different rows of a block hit
    /// different banks.
    pub pitch: u32,
    pub causal: bool,
    pub window: bool,
    pub sinks: bool,
    pub key_lengths: bool,
}

/// Where each tensor's (batch, head, row) strides sit in the kernels'
/// stride sequence, in units of three: the order of
/// `AttentionBackwardBuffers::layouts` (the forward's sequence holds the
/// first four).
pub(crate) const Q: usize = 0;
pub(crate) const K: usize = 1;
pub(crate) const V: usize = 2;
pub(crate) const OUT: usize = 3;
pub(crate) const DOUT: usize = 4;
pub(crate) const DQ: usize = 5;
pub(crate) const DK: usize = 6;
pub(crate) const DV: usize = 7;

/// The rows of one head of a `[batch, heads, seq, head_dim]` tensor: row
/// `r` starts at `base + r·stride` (in the kernel's units, elements or
/// vectors; the head dim is unit stride).
#[derive(CubeType, Clone, Copy)]
pub(crate) struct HeadRows {
    pub base: usize,
    pub stride: usize,
}

/// The rows of head `h` of batch entry `b` of `tensor` (one of [`Q`] ..
/// [`DV`]).
#[cube]
pub(crate) fn head_rows(
    strides: &Sequence<usize>,
    b: usize,
    h: usize,
    #[comptime] tensor: usize,
) -> HeadRows {
    let batch = *strides.index(comptime![3 * tensor]);
    let head = *strides.index(comptime![3 * tensor + 1]);
    HeadRows {
        base: b * batch + h * head,
        stride: *strides.index(comptime![3 * tensor + 2]),
    }
}

/// The rows a cube owns (query rows in the forwards and the dQ kernels,
/// key rows in the dK/dV kernels) and the blocks of the other side they
/// see.
#[derive(CubeType, Clone, Copy)]
pub(crate) struct OwnedRows {
    /// The batch entry; `dims.batch` for a cube past the grid (rounded
    /// up), which reads nothing.
    pub b: usize,
    /// The query head (query rows) or kv head (key rows).
    pub head: usize,
    /// The first owned row, and the last that exists.
    pub first: usize,
    pub last: usize,
    /// The keys of the batch entry that exist.
    pub klen: usize,
    /// Query `i` sits at key position `i + offset` (`seq_k − seq_q`,
    /// bottom-right aligned as Burn's causal mask; the launcher checks
    /// `seq_k ≥ seq_q` when a mask uses it).
    pub offset: usize,
    /// The blocks `[block_first, block_end)` of the other side (of
    /// `t.cols` rows, in each head of the group for key rows) that some
    /// owned row sees.
    pub block_first: usize,
    pub block_end: usize,
}

/// This cube's rows: query rows when `queries`, else key rows.
#[cube]
pub(crate) fn owned_rows(
    dims: &AttnDims,
    key_lengths: &Tensor<i32>,
    #[comptime] queries: bool,
    #[comptime] t: AttnTile,
) -> OwnedRows {
    let rows = comptime![t.rows as usize];
    let mut heads = dims.heads;
    let mut seq = dims.seq_q;
    if comptime![!queries] {
        heads = dims.heads / dims.group;
        seq = dims.seq_k;
    }
    // Query blocks go heaviest first under a causal mask.
    let (b, head, block) = cube_coords(dims.blocks, heads, dims.batch, queries, t);
    let first = block * rows;
    let last = select(first + rows < seq, first + rows, seq) - 1;
    let offset = dims.seq_k - dims.seq_q;
    // A cube past the grid reads batch entry 0's length, and nothing else.
    let entry = select(b < dims.batch, b, 0usize);
    let klen = key_count(key_lengths, entry, dims.seq_k, t);
    // The positions `[start, end)` of the other side some owned row sees.
    let mut start = 0usize;
    let mut end = dims.seq_q;
    if comptime![queries] {
        // Keys: none past the last query when causal, none a whole window
        // behind the first query.
        let q_first = first + offset;
        let q_last = last + offset;
        end = klen;
        if comptime![t.causal] {
            end = select(q_last + 1 < end, q_last + 1, end);
        }
        if comptime![t.window] {
            start = select(q_first + 1 > dims.window, q_first + 1 - dims.window, 0usize);
        }
    } else {
        // Queries: none before the keys when causal, none a whole window
        // past the last key.
        if comptime![t.causal] {
            start = select(first > offset, first - offset, 0usize);
        }
        if comptime![t.window] {
            let last_pos = last + dims.window;
            let window_end = select(last_pos > offset, last_pos - offset, 0usize);
            end = select(window_end < end, window_end, end);
        }
    }
    let cols = comptime![t.cols as usize];
    let block_first = start / cols;
    let block_end = end.div_ceil(cols);
    OwnedRows {
        b,
        head,
        first,
        last,
        klen,
        offset,
        block_first,
        block_end: select(block_end > block_first, block_end, block_first),
    }
}

/// Whether query position `qpos` (already shifted to the keys' frame) may
/// attend key `key`: a real key (below the batch entry's `klen`), not in
/// the future when causal, and fewer than `window` positions back.
#[cube]
pub(crate) fn allowed(
    qpos: usize,
    key: usize,
    klen: usize,
    window: usize,
    #[comptime] t: AttnTile,
) -> bool {
    let mut ok = key < klen;
    if comptime![t.causal] {
        ok = ok && key <= qpos;
    }
    if comptime![t.window] {
        ok = ok && key + window > qpos;
    }
    ok
}

/// `(batch, head, block)` of this cube. Batch entries and heads vary
/// fastest, so the cubes of one block index run side by side; under a
/// causal mask the blocks come in order of decreasing work (`reverse`:
/// the last block is the heaviest, as for query blocks), so every head's
/// heavy cubes start first and the grid ends on light ones, instead of
/// the last head's heaviest cube starting when the others are nearly
/// done. A cube past the grid (rounded up) gets the batch index `batch`.
#[cube]
pub(crate) fn cube_coords(
    blocks: usize,
    heads: usize,
    batch: usize,
    #[comptime] reverse: bool,
    #[comptime] t: AttnTile,
) -> (usize, usize, usize) {
    let pairs = batch * heads;
    let rank = CUBE_POS / pairs;
    let inside = rank < blocks;
    let bh = CUBE_POS % pairs;
    let mut block = rank;
    if comptime![reverse && t.causal] {
        block = blocks - 1 - select(inside, rank, blocks - 1);
    }
    (select(inside, bh / heads, batch), bh % heads, block)
}

/// The number of keys of batch entry `b` that exist: `seq_k`, or its
/// length from `key_lengths` (clamped to `[0, seq_k]`).
#[cube]
pub(crate) fn key_count(
    key_lengths: &Tensor<i32>,
    b: usize,
    seq_k: usize,
    #[comptime] t: AttnTile,
) -> usize {
    let mut klen = seq_k;
    if comptime![t.key_lengths] {
        let len = key_lengths[b];
        klen = select(len < 0, 0usize, usize::cast_from(len));
        klen = select(klen > seq_k, seq_k, klen);
    }
    klen
}

/// Copies rows `first .. first + rows` of one head into `smem`, zero past
/// `limit` rows. Every unit of the cube takes part.
#[cube]
pub(crate) fn load_block<F: Float>(
    src: &Tensor<F>,
    head: HeadRows,
    first: usize,
    limit: usize,
    smem: &mut SharedMemory<F>,
    #[comptime] rows: u32,
    #[comptime] t: AttnTile,
) {
    let units = comptime![(t.rows * t.upr) as usize];
    let d = comptime![t.head_dim as usize];
    let total = comptime![rows as usize * t.head_dim as usize];
    let iters = comptime![total.div_ceil(units)];
    let pitch = comptime![t.pitch as usize];
    #[unroll]
    for it in 0..iters {
        let i = UNIT_POS as usize + it * units;
        if i < total {
            let r = i / d;
            let c = i % d;
            let mut value = F::cast_from(0.0f32);
            if first + r < limit {
                value = src[head.base + (first + r) * head.stride + c];
            }
            smem[r * pitch + c] = value;
        }
    }
}

/// Scores of one row against the block: entry `j` is the f32 dot product
/// of row `a_row` of `a` with row `lane + j·upr` of `b` over the head dim.
/// The row's element is read once per head-dim step for all `cols / upr`
/// products.
#[cube]
pub(crate) fn row_scores<F: Float>(
    a: &SharedMemory<F>,
    a_row: usize,
    b: &SharedMemory<F>,
    lane: usize,
    #[comptime] t: AttnTile,
) -> Array<f32> {
    let pitch = comptime![t.pitch as usize];
    let upr = comptime![t.upr as usize];
    let sc = comptime![(t.cols / t.upr) as usize];
    let mut out = Array::<f32>::new(sc);
    #[unroll]
    for j in 0..sc {
        out[j] = 0.0f32;
    }
    for d in 0..comptime![t.head_dim as usize] {
        let x = f32::cast_from(a[a_row * pitch + d]);
        #[unroll]
        for j in 0..sc {
            out[j] += x * f32::cast_from(b[(lane + j * upr) * pitch + d]);
        }
    }
    out
}

/// `acc[j] += Σ_c weights[row, c] · block[c, lane + j·upr]`: one row of
/// `weights` (f32, `rows × cols`) times a block of rows held in `block`.
#[cube]
pub(crate) fn accumulate<F: Float>(
    acc: &mut Array<f32>,
    weights: &SharedMemory<f32>,
    row: usize,
    block: &SharedMemory<F>,
    lane: usize,
    #[comptime] t: AttnTile,
) {
    let pitch = comptime![t.pitch as usize];
    let upr = comptime![t.upr as usize];
    let cols = comptime![t.cols as usize];
    let dc = comptime![(t.head_dim / t.upr) as usize];
    for c in 0..cols {
        let w = weights[row * cols + c];
        #[unroll]
        for j in 0..dc {
            acc[j] += w * f32::cast_from(block[c * pitch + lane + j * upr]);
        }
    }
}
