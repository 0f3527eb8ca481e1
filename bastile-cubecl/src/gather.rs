//! Rows gathered and summed: `out[r] = Σ_c src[index[r, c]]` over the
//! `copies` entries of each output row, an entry outside `0..src_rows`
//! adding nothing (padding). The backward pass of a row gather whose
//! inverse is known: each source row sums the gradients of the rows that
//! copied it, in one pass over the rows it needs, where a composite
//! appends a zero row for the padding (a copy of every row), gathers every
//! entry's row and sums them (two more passes).
//!
//! A unit takes one vector of columns of one output row and sums its
//! copies in f32, in entry order, rounding once.

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::rows::Rows;
use crate::{FloatDtype, KernelError, launch};

/// Units per cube.
const UNITS: u32 = 256;

/// The shape of a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GatherSumProblem {
    /// Output rows.
    pub rows: usize,
    /// Entries per output row.
    pub copies: usize,
    /// Rows of the source.
    pub src_rows: usize,
    pub hidden: usize,
    pub dtype: FloatDtype,
    /// A number both row strides are a multiple of.
    pub stride_multiple: usize,
}

/// The buffers of a launch.
#[derive(Clone, Debug)]
pub struct GatherSumBuffers {
    /// `src_rows` rows of `hidden`.
    pub src: Rows,
    /// `rows · copies` i32 source rows, row-major.
    pub index: Handle,
    /// `rows` rows of `hidden`, written.
    pub out: Rows,
}

/// Writes every output row as the sum of the source rows its entries name.
pub fn gather_sum<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &GatherSumProblem,
    buffers: &GatherSumBuffers,
) -> Result<(), KernelError> {
    let p = problem;
    if p.stride_multiple == 0 {
        return Err(KernelError::Shape(
            "gathered rows' strides must be a positive multiple".into(),
        ));
    }
    let v = launch::vector_size(client, p.dtype, launch::gcd(p.hidden, p.stride_multiple));
    buffers
        .src
        .check("gathered source", p.src_rows, p.hidden, v, p.dtype)?;
    buffers
        .out
        .check("gathered sums", p.rows, p.hidden, v, p.dtype)?;
    launch::check_holds("gather index", &buffers.index, p.rows * p.copies, 4)?;
    if p.rows == 0 || p.hidden == 0 {
        return Ok(());
    }
    let row_vectors = p.hidden / v;
    let units = p.rows * row_vectors;
    unsafe {
        gather_sum_kernel::launch_unchecked::<R>(
            client,
            launch::cube_count(client, units.div_ceil(UNITS as usize))?,
            CubeDim::new_1d(UNITS),
            v,
            buffers.src.arg(p.src_rows, p.hidden),
            launch::flat_arg(&buffers.index, p.rows * p.copies),
            buffers.out.arg(p.rows, p.hidden),
            p.rows,
            p.copies,
            p.src_rows,
            row_vectors,
            buffers.src.stride_vecs(v),
            buffers.out.stride_vecs(v),
            p.dtype.storage(),
        )
    };
    Ok(())
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn gather_sum_kernel<F: Float, N: Size>(
    src: &Tensor<Vector<F, N>>,
    index: &Tensor<i32>,
    out: &mut Tensor<Vector<F, N>>,
    rows: usize,
    copies: usize,
    src_rows: usize,
    row_vectors: usize,
    src_stride: usize,
    out_stride: usize,
    #[define(F)] _dtype: StorageType,
) {
    let unit = CUBE_POS * UNITS as usize + UNIT_POS as usize;
    let row = unit / row_vectors;
    let col = unit % row_vectors;
    if row < rows {
        let mut acc = Vector::<f32, N>::new(0.0f32);
        for c in 0..copies {
            let entry = index[row * copies + c];
            if entry >= 0 {
                let from = usize::cast_from(entry);
                if from < src_rows {
                    acc += Vector::<f32, N>::cast_from(src[from * src_stride + col]);
                }
            }
        }
        out[row * out_stride + col] = Vector::<F, N>::cast_from(acc);
    }
}
