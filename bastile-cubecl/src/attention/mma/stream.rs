//! The blocks of the other side streamed past a tensor-core cube through
//! two stages of shared memory: the next block's asynchronous copies fly
//! while this one is multiplied. Query-owning cubes (forward, dQ) stream
//! keys and values; key-owning cubes (dK/dV, fused) stream queries,
//! output gradients and their rows' statistics.

use cubecl::prelude::barrier::{Barrier, copy_async};
use cubecl::prelude::*;

use crate::attention::AttnDims;

use super::super::tile::{AttnTile, DOUT, HeadRows, OwnedRows, Q, head_rows};
use super::backward::{KeySideInputs, NO_ROW, Stat};
use super::fragment::{Tile, copy_tile};
use super::mma_units;

/// Key blocks `[first, end)` of one kv head, in two stages of `cols`
/// padded rows each of `k` and `v`.
#[derive(CubeType, Clone, Copy)]
pub(crate) struct KeyStream<F: Float, N: Size> {
    pub k: Tile<F, N>,
    pub v: Tile<F, N>,
    barrier: Shared<Barrier>,
    k_rows: HeadRows,
    v_rows: HeadRows,
    seq_k: usize,
    first: usize,
    end: usize,
}

#[cube]
impl<F: Float, N: Size> KeyStream<F, N> {
    /// The stream, the first block's copies started.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        k: &Tensor<Vector<F, N>>,
        v: &Tensor<Vector<F, N>>,
        k_rows: HeadRows,
        v_rows: HeadRows,
        seq_k: usize,
        first: usize,
        end: usize,
        #[comptime] t: AttnTile,
    ) -> KeyStream<F, N> {
        let rows = comptime![2 * t.cols as usize * (t.head_dim as usize / 8 + 1)];
        let mut stream = KeyStream::<F, N> {
            k: SharedMemory::<Vector<F, N>>::new_aligned(rows, 16usize),
            v: SharedMemory::<Vector<F, N>>::new_aligned(rows, 16usize),
            barrier: Barrier::shared(CUBE_DIM, UNIT_POS == 0),
            k_rows,
            v_rows,
            seq_k,
            first,
            end,
        };
        if first < end {
            stream.copy(k, v, first, 0usize, t);
        }
        stream
    }

    /// Waits for block `kb`'s copies, then (every unit being past block
    /// `kb − 1`, its stage free) starts the next block's. Returns the first
    /// row of `kb`'s stage.
    pub fn wait(
        &mut self,
        k: &Tensor<Vector<F, N>>,
        v: &Tensor<Vector<F, N>>,
        kb: usize,
        #[comptime] t: AttnTile,
    ) -> usize {
        let cols = comptime![t.cols as usize];
        self.barrier.commit_copy_async();
        self.barrier.arrive_and_wait();
        let stage = (kb - self.first) % 2 * cols;
        if kb + 1 < self.end {
            self.copy(k, v, kb + 1, cols - stage, t);
        }
        stage
    }

    /// Starts the copies of block `kb` into rows `row0 ..` of the tiles;
    /// rows past the sequence get zeros.
    fn copy(
        &mut self,
        k: &Tensor<Vector<F, N>>,
        v: &Tensor<Vector<F, N>>,
        kb: usize,
        row0: usize,
        #[comptime] t: AttnTile,
    ) {
        let cols = comptime![t.cols as usize];
        let vecs = comptime![t.head_dim as usize / 8];
        let units = comptime![mma_units(t)];
        let first = kb * cols;
        let seq_k = self.seq_k;
        copy_tile::<F, N>(
            k,
            self.k_rows,
            first,
            seq_k,
            &mut self.k,
            row0,
            cols,
            vecs,
            units,
        );
        copy_tile::<F, N>(
            v,
            self.v_rows,
            first,
            seq_k,
            &mut self.v,
            row0,
            cols,
            vecs,
            units,
        );
    }
}

/// The sequence of (query head of the group, query block that sees the
/// cube's keys) of a key-owning cube, `blocks` query blocks from
/// `qb_first` per head: two stages of `cols` padded rows each of `q` and
/// `dout`, and of `stat` (per stage, the rows' `lse` then their `Δ`).
#[derive(CubeType, Clone, Copy)]
pub(crate) struct QueryStream<F: Float, N: Size> {
    pub q: Tile<F, N>,
    pub dout: Tile<F, N>,
    pub stat: SharedMemory<Stat>,
    barrier: Shared<Barrier>,
    /// Query blocks per head.
    blocks: usize,
    /// Blocks in the sequence: `group · blocks`.
    pub count: usize,
}

#[cube]
impl<F: Float, N: Size> QueryStream<F, N> {
    /// The stream, the first block's copies started.
    pub fn start(
        inputs: &KeySideInputs<F, N>,
        own: &OwnedRows,
        dims: &AttnDims,
        #[comptime] t: AttnTile,
    ) -> QueryStream<F, N> {
        let cols = comptime![t.cols as usize];
        let rows = comptime![2 * t.cols as usize * (t.head_dim as usize / 8 + 1)];
        let blocks = own.block_end - own.block_first;
        let mut stream = QueryStream::<F, N> {
            q: SharedMemory::<Vector<F, N>>::new_aligned(rows, 16usize),
            dout: SharedMemory::<Vector<F, N>>::new_aligned(rows, 16usize),
            stat: SharedMemory::<Stat>::new_aligned(comptime![4 * cols], 16usize),
            barrier: Barrier::shared(CUBE_DIM, UNIT_POS == 0),
            blocks,
            count: dims.group * blocks,
        };
        if stream.count > 0 {
            stream.copy(0usize, inputs, own, dims, t);
        }
        stream
    }

    /// Waits for block `i`'s copies, then (every unit being past block
    /// `i − 1`, its stage free) starts the next block's. Returns the first
    /// row of `i`'s stage.
    pub fn wait(
        &mut self,
        inputs: &KeySideInputs<F, N>,
        own: &OwnedRows,
        dims: &AttnDims,
        i: usize,
        #[comptime] t: AttnTile,
    ) -> usize {
        self.barrier.commit_copy_async();
        self.barrier.arrive_and_wait();
        if i + 1 < self.count {
            self.copy(i + 1, inputs, own, dims, t);
        }
        (i % 2) * comptime![t.cols as usize]
    }

    /// The query head of block `i`.
    pub fn head(&self, own: &OwnedRows, dims: &AttnDims, i: usize) -> usize {
        own.head * dims.group + i / self.blocks
    }

    /// The first query row of block `i`.
    pub fn first_query(&self, own: &OwnedRows, i: usize, #[comptime] t: AttnTile) -> usize {
        (own.block_first + i % self.blocks) * comptime![t.cols as usize]
    }

    /// Starts the copies of block `i`: its queries, output gradients and
    /// their rows' `lse` and `Δ`, into stage `i % 2`. Rows past the
    /// sequence get zeros and an `lse` that makes their probabilities 0.
    fn copy(
        &mut self,
        i: usize,
        inputs: &KeySideInputs<F, N>,
        own: &OwnedRows,
        dims: &AttnDims,
        #[comptime] t: AttnTile,
    ) {
        let cols = comptime![t.cols as usize];
        let vecs = comptime![t.head_dim as usize / 8];
        let units = comptime![mma_units(t)];
        let h = self.head(own, dims, i);
        let q0 = self.first_query(own, i, t);
        let row0 = (i % 2) * cols;
        let seq_q = dims.seq_q;
        let q_rows = head_rows(&inputs.strides, own.b, h, Q);
        let do_rows = head_rows(&inputs.strides, own.b, h, DOUT);
        copy_tile::<F, N>(
            &inputs.q,
            q_rows,
            q0,
            seq_q,
            &mut self.q,
            row0,
            cols,
            vecs,
            units,
        );
        copy_tile::<F, N>(
            &inputs.dout,
            do_rows,
            q0,
            seq_q,
            &mut self.dout,
            row0,
            cols,
            vecs,
            units,
        );
        let stat = (own.b * dims.heads + h) * seq_q + q0;
        let at = 2 * row0;
        #[unroll]
        for it in 0..comptime![cols.div_ceil(units)] {
            let j = UNIT_POS as usize + it * units;
            if j < cols {
                if q0 + j < seq_q {
                    copy_stat(&inputs.lse, stat + j, &mut self.stat, at + j);
                    copy_stat(&inputs.delta, stat + j, &mut self.stat, at + cols + j);
                } else {
                    self.stat[at + j] = Stat::new(NO_ROW);
                    self.stat[at + cols + j] = Stat::new(0.0f32);
                }
            }
        }
    }
}

/// Starts the asynchronous copy of one row statistic.
#[cube]
fn copy_stat(src: &Tensor<Stat>, from: usize, dst: &mut SharedMemory<Stat>, to: usize) {
    copy_async(
        &src.slice(from, from + 1),
        &mut dst.slice_mut(to, to + 1),
        1u32,
    );
}
