//! Register fragments of the tensor-core attention kernels.
//!
//! One `m16n8k16` product per instruction (`mma.sync`): A is 16×16, B is
//! 16×8, the f32 accumulator 16×8. Each lane of the 32-lane plane holds
//! pairs of neighbouring elements: in an accumulator, lane `l` holds row
//! `l/4` and row `l/4 + 8`, columns `2·(l%4)` and `2·(l%4) + 1`. An A
//! fragment is four such pairs: rows `l/4` and `l/4 + 8` of the left
//! half of its columns, then of the right half, which is exactly two
//! accumulators side by side: a block of probabilities computed as
//! accumulators becomes the A operand of the next product without leaving
//! the registers. The launcher enables these kernels only where the
//! runtime reports this layout (CUDA, 32-lane planes, `m16n8k16`).
//!
//! Tiles live in shared memory row-major, as vectors of 8 elements (16
//! bytes, what one `ldmatrix` row reads), each row padded by one vector so
//! the 8 rows one `ldmatrix` reads fall in different banks.

use cubecl::cmma::MmaDefinition;
use cubecl::ir::MatrixIdent;
use cubecl::prelude::barrier::copy_async;
use cubecl::prelude::*;

use super::super::tile::HeadRows;

/// Two neighbouring elements of one row, what a lane holds per register.
pub(crate) type Pair<E> = Vector<E, Const<2>>;
/// The registers of one fragment or accumulator.
pub(crate) type Frag<E> = Array<Pair<E>>;
/// A shared-memory tile of rows of 16-byte vectors.
pub(crate) type Tile<F, N> = SharedMemory<Vector<F, N>>;

#[cube]
pub(crate) fn mma_def<F: Float>() -> MmaDefinition<F, F, f32> {
    MmaDefinition::new(16usize, 8usize, 16usize)
}

/// A zeroed 16×8 f32 accumulator.
#[cube]
pub(crate) fn zero_acc() -> Frag<f32> {
    let mut acc = Array::<Pair<f32>>::new(2usize);
    acc[0usize] = Pair::<f32>::new(0.0f32);
    acc[1usize] = Pair::<f32>::new(0.0f32);
    acc
}

/// `n` zeroed accumulators.
#[cube]
pub(crate) fn zero_accs(#[comptime] n: usize) -> Sequence<Frag<f32>> {
    let mut accs = Sequence::new();
    #[unroll]
    for _ in 0..n {
        accs.push(zero_acc());
    }
    accs
}

/// `acc += a · b`.
#[cube]
fn mma<F: Float>(a: &Frag<F>, b: &Frag<F>, acc: &mut Frag<f32>) {
    mma_def::<F>().execute_inplace(a, b, acc);
}

/// Registers `first` and `first + 1` of a four-register load: one B
/// fragment of a paired load.
#[cube]
fn half<F: Float>(regs: &Frag<F>, #[comptime] first: usize) -> Frag<F> {
    let mut out = Array::<Pair<F>>::new(2usize);
    out[0usize] = regs[first];
    out[1usize] = regs[first + 1];
    out
}

/// `acc[j] += a · B₀` and `acc[j + 1] += a · B₁`, where `B₀` and `B₁` are
/// the two B fragments of one paired load (registers 0-1 and 2-3).
#[cube]
pub(crate) fn mma_pair<F: Float>(
    a: &Frag<F>,
    pair: &Frag<F>,
    acc: &mut Sequence<Frag<f32>>,
    #[comptime] j: usize,
) {
    mma::<F>(a, &half::<F>(pair, 0usize), acc.index_mut(j));
    mma::<F>(a, &half::<F>(pair, 2usize), acc.index_mut(j + 1));
}

/// Four 8×8 matrices, lane `l` giving the address of row `l % 8` of
/// matrix `l / 8` (its vector `idx` of the tile); transposed for B
/// operands stored with the reduction along rows.
#[cube]
fn ldmatrix_x4<F: Float, N: Size>(
    tile: &Tile<F, N>,
    idx: usize,
    #[comptime] transpose: bool,
) -> Frag<F> {
    mma_def::<F>().load_matrix::<Vector<F, N>, Const<2>>(
        &tile.slice(idx, idx + 1),
        MatrixIdent::B,
        4usize,
        transpose,
    )
}

// Fragment addresses. Each load below reads at `base + offset`: `base`
// (from one of the `*_base` functions) holds the lane's part of the
// address and the runtime rows and columns, computed once per tile and
// block; `offset` is a compile-time constant, so every `ldmatrix` of a
// block shares one register and folds its offset into the instruction.
// (Were the lane's bits and the constants added term by term, the
// compiler would merge them bitwise and recompute each address.)

/// The base of [`load_a`] reads: A fragments of a row-major tile whose
/// rows start at `row0` and columns at `col0` (a multiple of 8). Lanes
/// 0-15 give the rows of the left 8 columns, 16-31 the right.
#[cube]
pub(crate) fn a_base(row0: usize, col0: usize, #[comptime] pitch: usize) -> usize {
    let lane = UNIT_POS_PLANE as usize;
    (row0 + lane % 16) * pitch + col0 / 8 + lane / 16
}

/// The base of [`load_b_rows`] reads from rows `row0 ..` (the product's
/// columns), columns `col0 ..`; also of [`load_a_trans`] reads of a
/// transposed A whose first row is `row0` and first column `col0`, with
/// the arguments swapped (`rows_base(col0, row0, pitch)`).
#[cube]
pub(crate) fn rows_base(row0: usize, col0: usize, #[comptime] pitch: usize) -> usize {
    let lane = UNIT_POS_PLANE as usize;
    (row0 + (lane / 16) * 8 + lane % 8) * pitch + col0 / 8 + (lane / 8) % 2
}

/// The base of [`load_b_cols`] reads from rows `row0 ..` (the reduction),
/// columns `col0 ..` (the product's columns).
#[cube]
pub(crate) fn cols_base(row0: usize, col0: usize, #[comptime] pitch: usize) -> usize {
    let lane = UNIT_POS_PLANE as usize;
    (row0 + ((lane / 8) % 2) * 8 + lane % 8) * pitch + col0 / 8 + lane / 16
}

/// The A fragment of rows `row .. row + 16`, columns `col .. col + 16`
/// past the base's (`col` a multiple of 8; `pitch` in vectors).
#[cube]
pub(crate) fn load_a<F: Float, N: Size>(
    tile: &Tile<F, N>,
    base: usize,
    #[comptime] row: usize,
    #[comptime] col: usize,
    #[comptime] pitch: usize,
) -> Frag<F> {
    ldmatrix_x4::<F, N>(tile, base + comptime![row * pitch + col / 8], false)
}

/// The A fragment of rows `row .. row + 16`, columns `col .. col + 16`
/// past the base's, of a matrix stored transposed (tile row `c` holds
/// column `c`; `row` a multiple of 8), as `dS` read from a `dSᵀ` tile.
/// Matrix `j = lane / 8` covers rows `8·(j % 2)` and columns `8·(j / 2)`
/// of the fragment.
#[cube]
pub(crate) fn load_a_trans<F: Float, N: Size>(
    tile: &Tile<F, N>,
    base: usize,
    #[comptime] row: usize,
    #[comptime] col: usize,
    #[comptime] pitch: usize,
) -> Frag<F> {
    ldmatrix_x4::<F, N>(tile, base + comptime![col * pitch + row / 8], true)
}

/// Two B fragments (registers 0-1 and 2-3) from a tile whose rows are the
/// product's columns (`Xᵀ` of a row-major `X`, as `K` in `Q·Kᵀ`): the
/// reduction runs over columns `col .. col + 16` past the base's, the two
/// fragments over rows `row .. row + 8` and `row + 8 .. row + 16`.
#[cube]
pub(crate) fn load_b_rows<F: Float, N: Size>(
    tile: &Tile<F, N>,
    base: usize,
    #[comptime] row: usize,
    #[comptime] col: usize,
    #[comptime] pitch: usize,
) -> Frag<F> {
    ldmatrix_x4::<F, N>(tile, base + comptime![row * pitch + col / 8], false)
}

/// Two B fragments (registers 0-1 and 2-3) from a row-major tile used as
/// is (`V` in `P·V`): the reduction runs over rows `row .. row + 16` past
/// the base's, the two fragments over columns `col .. col + 8` and
/// `col + 8 .. col + 16`.
#[cube]
pub(crate) fn load_b_cols<F: Float, N: Size>(
    tile: &Tile<F, N>,
    base: usize,
    #[comptime] row: usize,
    #[comptime] col: usize,
    #[comptime] pitch: usize,
) -> Frag<F> {
    ldmatrix_x4::<F, N>(tile, base + comptime![row * pitch + col / 8], true)
}

/// `mt·sn` accumulators of `A·Bᵀ` (accumulator `m·sn + n`): rows
/// `row0 + 16·m ..` of tile `a` against rows `first .. first + 8·sn` of
/// tile `b`, both row-major over the `16·ksteps` reduction columns. Every
/// B fragment feeds all `mt` row tiles, so shared-memory reads per product
/// fall as `mt` grows.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn products<F: Float, N: Size>(
    a: &Tile<F, N>,
    row0: usize,
    b: &Tile<F, N>,
    first: usize,
    #[comptime] mt: usize,
    #[comptime] sn: usize,
    #[comptime] ksteps: usize,
    #[comptime] pitch: usize,
) -> Sequence<Frag<f32>> {
    let mut acc = zero_accs(mt * sn);
    let at_a = a_base(row0, 0usize, pitch);
    let at_b = rows_base(first, 0usize, pitch);
    #[unroll]
    for ks in 0..ksteps {
        let mut frags = Sequence::<Frag<F>>::new();
        #[unroll]
        for m in 0..mt {
            frags.push(load_a::<F, N>(a, at_a, m * 16, ks * 16, pitch));
        }
        #[unroll]
        for np in 0..comptime![sn / 2] {
            let pair = load_b_rows::<F, N>(b, at_b, np * 16, ks * 16, pitch);
            #[unroll]
            for m in 0..mt {
                mma_pair::<F>(frags.index(m), &pair, &mut acc, comptime![m * sn + 2 * np]);
            }
        }
    }
    acc
}

/// `acc[m·n + j] += A·B` over `16·ksteps` reduction steps: A is rows
/// `row0 + 16·m ..` of tile `a` (pitch `a_pitch`), or with `trans_a` of
/// the matrix tile `a` holds transposed; B is rows `first ..` of the
/// row-major tile `b`, columns `col0 .. col0 + 8·n`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn accumulate_tiles<F: Float, N: Size>(
    acc: &mut Sequence<Frag<f32>>,
    a: &Tile<F, N>,
    row0: usize,
    b: &Tile<F, N>,
    first: usize,
    col0: usize,
    #[comptime] trans_a: bool,
    #[comptime] a_pitch: usize,
    #[comptime] pitch: usize,
    #[comptime] mt: usize,
    #[comptime] n: usize,
    #[comptime] ksteps: usize,
) {
    let at_a = if comptime![trans_a] {
        rows_base(0usize, row0, a_pitch)
    } else {
        a_base(row0, 0usize, a_pitch)
    };
    let at_b = cols_base(first, col0, pitch);
    #[unroll]
    for ks in 0..ksteps {
        let mut frags = Sequence::<Frag<F>>::new();
        #[unroll]
        for m in 0..mt {
            if comptime![trans_a] {
                frags.push(load_a_trans::<F, N>(a, at_a, m * 16, ks * 16, a_pitch));
            } else {
                frags.push(load_a::<F, N>(a, at_a, m * 16, ks * 16, a_pitch));
            }
        }
        #[unroll]
        for dp in 0..comptime![n / 2] {
            let pair = load_b_cols::<F, N>(b, at_b, ks * 16, dp * 16, pitch);
            #[unroll]
            for m in 0..mt {
                mma_pair::<F>(frags.index(m), &pair, acc, comptime![m * n + 2 * dp]);
            }
        }
    }
}

/// Writes accumulators `first .. first + n` (16 rows from `row0`, side by
/// side from column `col0`, a multiple of 8) into a padded tile of `pitch`
/// vectors per row, the top 8 rows times `scale_top`, the bottom 8 times
/// `scale_bottom`, rounded to the input dtype.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn stage_accs<F: Float, N: Size>(
    accs: &Sequence<Frag<f32>>,
    tile: &mut Tile<F, N>,
    row0: usize,
    col0: usize,
    scale_top: f32,
    scale_bottom: f32,
    #[comptime] first: usize,
    #[comptime] n: usize,
    #[comptime] pitch: usize,
) {
    let lane = UNIT_POS_PLANE as usize;
    let pitch2 = comptime![pitch * 4];
    let mut pairs = tile.to_slice_mut().with_vector_size::<Const<2>>();
    let top = (row0 + lane / 4) * pitch2 + col0 / 2 + lane % 4;
    #[unroll]
    for j in 0..n {
        let acc = accs.index(first + j);
        pairs[top + j * 4] = Pair::<F>::cast_from(acc[0usize] * Pair::<f32>::new(scale_top));
        pairs[top + 8 * pitch2 + j * 4] =
            Pair::<F>::cast_from(acc[1usize] * Pair::<f32>::new(scale_bottom));
    }
}

/// The A fragment made of accumulators `2·kk` and `2·kk + 1` (16 rows, 16
/// columns), rounded to the input dtype.
#[cube]
pub(crate) fn acc_to_a<F: Float>(accs: &Sequence<Frag<f32>>, #[comptime] kk: usize) -> Frag<F> {
    let left = accs.index(2 * kk);
    let right = accs.index(2 * kk + 1);
    let mut a = Array::<Pair<F>>::new(4usize);
    a[0usize] = Pair::<F>::cast_from(left[0usize]);
    a[1usize] = Pair::<F>::cast_from(left[1usize]);
    a[2usize] = Pair::<F>::cast_from(right[0usize]);
    a[3usize] = Pair::<F>::cast_from(right[1usize]);
    a
}

/// The maximum over the four lanes that share an accumulator row.
#[cube]
pub(crate) fn quad_max(x: f32) -> f32 {
    let a = f32::max(x, plane_shuffle_xor(x, 1u32));
    f32::max(a, plane_shuffle_xor(a, 2u32))
}

/// The sum over the four lanes that share an accumulator row.
#[cube]
pub(crate) fn quad_sum(x: f32) -> f32 {
    let a = x + plane_shuffle_xor(x, 1u32);
    a + plane_shuffle_xor(a, 2u32)
}

/// Copies rows `first .. first + rows` of one head (`d/8` vectors each)
/// into a padded tile, zeros past `limit`. Every unit of the cube takes
/// part.
#[cube]
pub(crate) fn load_tile<F: Float, N: Size>(
    src: &Tensor<Vector<F, N>>,
    head: HeadRows,
    first: usize,
    limit: usize,
    tile: &mut Tile<F, N>,
    #[comptime] rows: usize,
    #[comptime] vecs: usize,
    #[comptime] units: usize,
) {
    let pitch = comptime![vecs + 1];
    let total = comptime![rows * vecs];
    #[unroll]
    for it in 0..comptime![total.div_ceil(units)] {
        let i = UNIT_POS as usize + it * units;
        if i < total {
            let r = i / vecs;
            let c = i % vecs;
            let mut value = Vector::<F, N>::new(F::cast_from(0.0f32));
            if first + r < limit {
                value = src[head.base + (first + r) * head.stride + c];
            }
            tile[r * pitch + c] = value;
        }
    }
}

/// Writes rows `row0 .. row0 + 16` of a padded tile to rows `first ..` of
/// one head in global memory, skipping rows at or past `limit`. One plane.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn store_rows<F: Float, N: Size>(
    tile: &Tile<F, N>,
    row0: usize,
    dst: &mut Tensor<Vector<F, N>>,
    head: HeadRows,
    first: usize,
    limit: usize,
    #[comptime] vecs: usize,
) {
    let lane = UNIT_POS_PLANE as usize;
    let pitch = comptime![vecs + 1];
    let total = comptime![16 * vecs];
    #[unroll]
    for it in 0..comptime![total.div_ceil(32)] {
        let i = lane + it * 32;
        let r = i / vecs;
        let c = i % vecs;
        if i < total && first + r < limit {
            dst[head.base + (first + r) * head.stride + c] = tile[(row0 + r) * pitch + c];
        }
    }
}

/// [`load_tile`] without waiting: each unit issues asynchronous 16-byte
/// copies of its vectors into rows `row0 ..` of the tile (zeros past
/// `limit` are stored directly). The copies land by the next
/// `commit_copy_async` + `arrive_and_wait` on the cube's barrier.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn copy_tile<F: Float, N: Size>(
    src: &Tensor<Vector<F, N>>,
    head: HeadRows,
    first: usize,
    limit: usize,
    tile: &mut Tile<F, N>,
    row0: usize,
    #[comptime] rows: usize,
    #[comptime] vecs: usize,
    #[comptime] units: usize,
) {
    let pitch = comptime![vecs + 1];
    let total = comptime![rows * vecs];
    // Where the units cover whole rows per round, a block entirely inside
    // the sequence (every block but the last) takes the unchecked path:
    // one source address per unit, then a multiple of the row stride per
    // round, with no per-row branch or zero store in the block loop.
    let step = comptime![(units / vecs).max(1)];
    let mut whole = false;
    if comptime![units.is_multiple_of(vecs) && total.is_multiple_of(units)] {
        whole = first + rows <= limit;
    }
    if whole {
        let r = UNIT_POS as usize / vecs;
        let c = UNIT_POS as usize % vecs;
        let from = head.base + (first + r) * head.stride + c;
        let to = (row0 + r) * pitch + c;
        let jump = step * head.stride;
        #[unroll]
        for it in 0..comptime![rows / step] {
            let at = from + it * jump;
            let dst = to + comptime![it * step * pitch];
            copy_async(
                &src.slice(at, at + 1),
                &mut tile.slice_mut(dst, dst + 1),
                8u32,
            );
        }
    } else {
        #[unroll]
        for it in 0..comptime![total.div_ceil(units)] {
            let i = UNIT_POS as usize + it * units;
            if i < total {
                let r = i / vecs;
                let c = i % vecs;
                let dst = (row0 + r) * pitch + c;
                if first + r < limit {
                    let at = head.base + (first + r) * head.stride + c;
                    copy_async(
                        &src.slice(at, at + 1),
                        &mut tile.slice_mut(dst, dst + 1),
                        8u32,
                    );
                } else {
                    tile[dst] = Vector::<F, N>::new(F::cast_from(0.0f32));
                }
            }
        }
    }
}
