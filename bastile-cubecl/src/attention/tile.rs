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
    /// Rows hold several documents (`doc_starts`): a query sees only the
    /// keys of its own document.
    pub documents: bool,
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
    /// The window and document bound of the first and the last owned row:
    /// for query rows the first key they see ([`first_key`]), for key rows
    /// the end of the query positions that see them ([`query_end`]).
    pub first_bound: usize,
    pub last_bound: usize,
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
    doc_starts: &Tensor<i32>,
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
    let (seq_k, window) = (dims.seq_k, dims.window);
    // Owned rows' positions in the keys' frame.
    let frame = select(queries, offset, 0usize);
    let first_bound = row_bound(doc_starts, entry, first + frame, seq_k, window, queries, t);
    let last_bound = row_bound(doc_starts, entry, last + frame, seq_k, window, queries, t);
    // The positions `[start, end)` of the other side some owned row sees.
    let mut start = 0usize;
    let mut end = dims.seq_q;
    if comptime![queries] {
        // Keys: none past the last query when causal, none before the
        // first query's window or document (both bounds only grow along
        // the rows).
        start = first_bound;
        end = klen;
        if comptime![t.causal] {
            end = select(last + offset + 1 < end, last + offset + 1, end);
        }
    } else {
        // Queries: none before the keys when causal, none past the last
        // key's window or document.
        if comptime![t.causal] {
            start = select(first > offset, first - offset, 0usize);
        }
        if comptime![t.window || t.documents] {
            let bound_end = select(last_bound > offset, last_bound - offset, 0usize);
            end = select(bound_end < end, bound_end, end);
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
        first_bound,
        last_bound,
        block_first,
        block_end: select(block_end > block_first, block_end, block_first),
    }
}

/// The mask bound of the owned row at key position `pos`: the first key
/// a query row sees, or the end of the queries that see a key row.
#[cube]
fn row_bound(
    doc_starts: &Tensor<i32>,
    b: usize,
    pos: usize,
    seq_k: usize,
    window: usize,
    #[comptime] queries: bool,
    #[comptime] t: AttnTile,
) -> usize {
    if comptime![queries] {
        first_key(doc_starts, b, pos, seq_k, window, t)
    } else {
        query_end(doc_starts, b, pos, seq_k, window, t)
    }
}

/// The first key the query at key position `qpos` sees: the first of its
/// sliding window and of its document (0 without either). Never decreases
/// along the rows.
#[cube]
pub(crate) fn first_key(
    doc_starts: &Tensor<i32>,
    b: usize,
    qpos: usize,
    seq_k: usize,
    window: usize,
    #[comptime] t: AttnTile,
) -> usize {
    let mut first = 0usize;
    if comptime![t.window] {
        first = select(qpos + 1 > window, qpos + 1 - window, 0usize);
    }
    if comptime![t.documents] {
        let start = document_start(doc_starts, b, qpos, seq_k);
        first = select(start > first, start, first);
    }
    first
}

/// One past the last query position (in the keys' frame) that sees key
/// `key` under the window and the document masks: the end of its window
/// and of its document (`seq_k` without either). Never decreases along
/// the keys. Only the causal mask bounds the queries from below.
#[cube]
pub(crate) fn query_end(
    doc_starts: &Tensor<i32>,
    b: usize,
    key: usize,
    seq_k: usize,
    window: usize,
    #[comptime] t: AttnTile,
) -> usize {
    let mut end = seq_k;
    if comptime![t.window] {
        end = select(key + window < end, key + window, end);
    }
    if comptime![t.documents] {
        let doc_end = document_end(doc_starts, b, key, seq_k);
        end = select(doc_end < end, doc_end, end);
    }
    end
}

/// Where the document of position `pos` of batch entry `b` starts:
/// `doc_starts[b, pos]`, clamped into `[0, pos]` (positions past the
/// sequence take the last one's).
#[cube]
fn document_start(doc_starts: &Tensor<i32>, b: usize, pos: usize, seq_k: usize) -> usize {
    let at = select(pos < seq_k, pos, seq_k - 1);
    let start = doc_starts[b * seq_k + at];
    let start = select(start < 0, 0usize, usize::cast_from(start));
    select(start > at, at, start)
}

/// One past the last position of `key`'s document: the first later
/// position whose document starts after `key` (`seq_k` if none), found
/// by bisection, since document starts never decrease along a row.
#[cube]
fn document_end(doc_starts: &Tensor<i32>, b: usize, key: usize, seq_k: usize) -> usize {
    let mut lo = select(key < seq_k, key + 1, seq_k);
    let mut hi = seq_k;
    loop {
        if lo >= hi {
            break;
        }
        let mid = (lo + hi) / 2;
        if document_start(doc_starts, b, mid, seq_k) > key {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    lo
}

/// Whether query position `qpos` (already shifted to the keys' frame) may
/// attend key `key`, from the query's side: a real key (below the batch
/// entry's `klen`), not in the future when causal, and not before the
/// query's [`first_key`].
#[cube]
pub(crate) fn allowed(
    qpos: usize,
    key: usize,
    first_key: usize,
    klen: usize,
    #[comptime] t: AttnTile,
) -> bool {
    visible(qpos, key, klen, key >= first_key, t)
}

/// [`allowed`] from the key's side: the query position lies before the
/// key's [`query_end`]. The same test where the kernel owns keys and
/// knows their bounds instead of the queries'.
#[cube]
pub(crate) fn seen_by(
    qpos: usize,
    key: usize,
    query_end: usize,
    klen: usize,
    #[comptime] t: AttnTile,
) -> bool {
    visible(qpos, key, klen, qpos < query_end, t)
}

/// The mask: a real key, not in the query's future when causal, and
/// `bounded` (the pair passes the window and document bounds) where the
/// problem has either.
#[cube]
fn visible(qpos: usize, key: usize, klen: usize, bounded: bool, #[comptime] t: AttnTile) -> bool {
    let mut ok = key < klen;
    if comptime![t.causal] {
        ok = ok && key <= qpos;
    }
    if comptime![t.window || t.documents] {
        ok = ok && bounded;
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
