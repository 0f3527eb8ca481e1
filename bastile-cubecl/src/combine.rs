//! Routed experts' output rows combined per token: `out[t] = Σ_j
//! w[t, j] · rows[row_of_slot[t, j]]` over the token's `top_k` choices,
//! and the two gradients of that sum. A choice whose row lies outside the
//! rows adds nothing (and has a zero weight gradient); a row no choice
//! holds (a group's padding) gets a zero gradient.
//!
//! The composite gathers every choice's row into a `[tokens, top_k,
//! hidden]` copy, weights and sums it; its backward broadcasts the output
//! gradient to that shape, weights it, gathers it back to the rows and
//! reduces the products for the weights. Here each pass reads the rows
//! where they are: one unit per token (or row) and vector of columns,
//! products and sums in f32, rounded once; the weights' gradient is one
//! cube per choice reducing its dot product.

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::reduce::{CubeRowSum, cube_row_sum, row_sum};
use crate::rows::Rows;
use crate::{FloatDtype, KernelError, launch};

/// Units per cube of the row-wise kernels.
const UNITS: u32 = 256;
/// Units per cube of the weights' gradient (one cube per choice).
const DOT_UNITS: u32 = 64;

/// The shape of a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CombineProblem {
    pub tokens: usize,
    /// Choices per token.
    pub top_k: usize,
    /// The experts' output rows.
    pub rows: usize,
    pub hidden: usize,
    pub dtype: FloatDtype,
    /// A number every row stride of the launch is a multiple of.
    pub stride_multiple: usize,
}

impl CombineProblem {
    fn slots(&self) -> usize {
        self.tokens * self.top_k
    }

    fn vector<R: Runtime>(&self, client: &ComputeClient<R>) -> Result<usize, KernelError> {
        if self.stride_multiple == 0 {
            return Err(KernelError::Shape(
                "combined rows' strides must be a positive multiple".into(),
            ));
        }
        launch::check_i32("choices", self.slots())?;
        launch::check_i32("combined rows", self.rows)?;
        Ok(launch::vector_size(
            client,
            self.dtype,
            launch::gcd(self.hidden, self.stride_multiple),
        ))
    }

    /// The vector width of a pass over a token-row matrix and an
    /// expert-row matrix (each named for errors) with the weights, its
    /// buffers checked.
    fn row_pass<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        (token_what, token_rows): (&str, &Rows),
        (expert_what, expert_rows): (&str, &Rows),
        weights: &Handle,
    ) -> Result<usize, KernelError> {
        let v = self.vector(client)?;
        token_rows.check(token_what, self.tokens, self.hidden, v, self.dtype)?;
        expert_rows.check(expert_what, self.rows, self.hidden, v, self.dtype)?;
        launch::check_holds("combine weights", weights, self.slots(), self.dtype.size())?;
        Ok(v)
    }
}

/// The forward pass's buffers.
#[derive(Clone, Debug)]
pub struct CombineBuffers {
    /// `rows` rows of `hidden`.
    pub rows: Rows,
    /// Dense `tokens × top_k` weights, the rows' dtype.
    pub weights: Handle,
    /// `tokens × top_k` i32: each choice's row.
    pub row_of_slot: Handle,
    /// `tokens` rows of `hidden`, written.
    pub out: Rows,
}

/// Writes every token's weighted sum of its choices' rows.
pub fn combine<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &CombineProblem,
    buffers: &CombineBuffers,
) -> Result<(), KernelError> {
    let p = problem;
    let v = p.row_pass(
        client,
        ("combined output", &buffers.out),
        ("combined rows", &buffers.rows),
        &buffers.weights,
    )?;
    launch::check_holds("row of each choice", &buffers.row_of_slot, p.slots(), 4)?;
    if p.tokens == 0 || p.hidden == 0 {
        return Ok(());
    }
    let row_vectors = p.hidden / v;
    let units = p.tokens * row_vectors;
    unsafe {
        combine_kernel::launch_unchecked::<R>(
            client,
            launch::cube_count(client, units.div_ceil(UNITS as usize))?,
            CubeDim::new_1d(UNITS),
            v,
            buffers.rows.arg(p.rows, p.hidden),
            launch::flat_arg(&buffers.weights, p.slots()),
            launch::flat_arg(&buffers.row_of_slot, p.slots()),
            buffers.out.arg(p.tokens, p.hidden),
            p.tokens,
            p.top_k,
            p.rows,
            row_vectors,
            buffers.rows.stride_vecs(v),
            buffers.out.stride_vecs(v),
            p.dtype.storage(),
        )
    };
    Ok(())
}

/// The rows' gradient's buffers.
#[derive(Clone, Debug)]
pub struct CombineRowsGradBuffers {
    /// `tokens` rows of `hidden`: the output's gradient.
    pub dout: Rows,
    /// Dense `tokens × top_k` weights, the gradient's dtype.
    pub weights: Handle,
    /// `rows` i32: the choice each row holds (`t · top_k + j`); a value
    /// outside the choices (a group's padding) holds none.
    pub slot_of_row: Handle,
    /// `rows` rows of `hidden`, written.
    pub drows: Rows,
}

/// Writes every row's gradient: its choice's weight times its token's
/// output gradient, zero for a row no choice holds.
pub fn combine_rows_grad<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &CombineProblem,
    buffers: &CombineRowsGradBuffers,
) -> Result<(), KernelError> {
    let p = problem;
    let v = p.row_pass(
        client,
        ("combined output's gradient", &buffers.dout),
        ("combined rows' gradient", &buffers.drows),
        &buffers.weights,
    )?;
    launch::check_holds("choice of each row", &buffers.slot_of_row, p.rows, 4)?;
    if p.rows == 0 || p.hidden == 0 {
        return Ok(());
    }
    let row_vectors = p.hidden / v;
    let units = p.rows * row_vectors;
    unsafe {
        combine_rows_grad_kernel::launch_unchecked::<R>(
            client,
            launch::cube_count(client, units.div_ceil(UNITS as usize))?,
            CubeDim::new_1d(UNITS),
            v,
            buffers.dout.arg(p.tokens, p.hidden),
            launch::flat_arg(&buffers.weights, p.slots()),
            launch::flat_arg(&buffers.slot_of_row, p.rows),
            buffers.drows.arg(p.rows, p.hidden),
            p.slots(),
            p.top_k,
            p.rows,
            row_vectors,
            buffers.dout.stride_vecs(v),
            buffers.drows.stride_vecs(v),
            p.dtype.storage(),
        )
    };
    Ok(())
}

/// The weights' gradient's buffers.
#[derive(Clone, Debug)]
pub struct CombineWeightsGradBuffers {
    /// `tokens` rows of `hidden`: the output's gradient.
    pub dout: Rows,
    /// `rows` rows of `hidden`.
    pub rows: Rows,
    /// `tokens × top_k` i32: each choice's row.
    pub row_of_slot: Handle,
    /// Dense `tokens × top_k`, the rows' dtype, written.
    pub dweights: Handle,
}

/// Writes every choice's weight gradient: the dot product of its token's
/// output gradient and its row (f32, rounded once), zero for a row
/// outside the rows.
pub fn combine_weights_grad<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &CombineProblem,
    buffers: &CombineWeightsGradBuffers,
) -> Result<(), KernelError> {
    let p = problem;
    p.vector(client)?;
    buffers
        .dout
        .check("combined output's gradient", p.tokens, p.hidden, 1, p.dtype)?;
    buffers
        .rows
        .check("combined rows", p.rows, p.hidden, 1, p.dtype)?;
    launch::check_holds("row of each choice", &buffers.row_of_slot, p.slots(), 4)?;
    launch::check_holds(
        "combine weights' gradient",
        &buffers.dweights,
        p.slots(),
        p.dtype.size(),
    )?;
    if p.slots() == 0 {
        return Ok(());
    }
    let cfg = cube_row_sum(client, DOT_UNITS)?;
    unsafe {
        combine_weights_grad_kernel::launch_unchecked::<R>(
            client,
            launch::cube_count(client, p.slots())?,
            CubeDim::new_1d(DOT_UNITS),
            buffers.dout.arg(p.tokens, p.hidden),
            buffers.rows.arg(p.rows, p.hidden),
            launch::flat_arg(&buffers.row_of_slot, p.slots()),
            launch::flat_arg(&buffers.dweights, p.slots()),
            p.slots(),
            p.top_k,
            p.rows,
            p.hidden,
            buffers.dout.stride,
            buffers.rows.stride,
            cfg,
            p.dtype.storage(),
        )
    };
    Ok(())
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn combine_kernel<F: Float, N: Size>(
    rows: &Tensor<Vector<F, N>>,
    weights: &Tensor<F>,
    row_of_slot: &Tensor<i32>,
    out: &mut Tensor<Vector<F, N>>,
    tokens: usize,
    top_k: usize,
    row_count: usize,
    row_vectors: usize,
    rows_stride: usize,
    out_stride: usize,
    #[define(F)] _dtype: StorageType,
) {
    let unit = CUBE_POS * UNITS as usize + UNIT_POS as usize;
    let token = unit / row_vectors;
    let col = unit % row_vectors;
    if token < tokens {
        let mut acc = Vector::<f32, N>::new(0.0f32);
        for j in 0..top_k {
            let slot = token * top_k + j;
            let row = row_of_slot[slot];
            if row >= 0 {
                let row = usize::cast_from(row);
                if row < row_count {
                    let w = Vector::<f32, N>::new(f32::cast_from(weights[slot]));
                    acc += w * Vector::<f32, N>::cast_from(rows[row * rows_stride + col]);
                }
            }
        }
        out[token * out_stride + col] = Vector::<F, N>::cast_from(acc);
    }
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn combine_rows_grad_kernel<F: Float, N: Size>(
    dout: &Tensor<Vector<F, N>>,
    weights: &Tensor<F>,
    slot_of_row: &Tensor<i32>,
    drows: &mut Tensor<Vector<F, N>>,
    slots: usize,
    top_k: usize,
    row_count: usize,
    row_vectors: usize,
    dout_stride: usize,
    drows_stride: usize,
    #[define(F)] _dtype: StorageType,
) {
    let unit = CUBE_POS * UNITS as usize + UNIT_POS as usize;
    let row = unit / row_vectors;
    let col = unit % row_vectors;
    if row < row_count {
        let mut grad = Vector::<f32, N>::new(0.0f32);
        let slot = slot_of_row[row];
        if slot >= 0 {
            let slot = usize::cast_from(slot);
            if slot < slots {
                let w = Vector::<f32, N>::new(f32::cast_from(weights[slot]));
                let token = slot / top_k;
                grad = w * Vector::<f32, N>::cast_from(dout[token * dout_stride + col]);
            }
        }
        drows[row * drows_stride + col] = Vector::<F, N>::cast_from(grad);
    }
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn combine_weights_grad_kernel<F: Float>(
    dout: &Tensor<F>,
    rows: &Tensor<F>,
    row_of_slot: &Tensor<i32>,
    dweights: &mut Tensor<F>,
    slots: usize,
    top_k: usize,
    row_count: usize,
    hidden: usize,
    dout_stride: usize,
    rows_stride: usize,
    #[comptime] cfg: CubeRowSum,
    #[define(F)] _dtype: StorageType,
) {
    let slot = CUBE_POS;
    // The whole cube takes the branch or skips it: the reduction's
    // barriers are uniform.
    if slot < slots {
        let unit = UNIT_POS as usize;
        let row = row_of_slot[slot];
        let mut sum = 0.0f32;
        if row >= 0 && usize::cast_from(row) < row_count {
            let from = usize::cast_from(row) * rows_stride;
            let grad = (slot / top_k) * dout_stride;
            let mut c = unit;
            while c < hidden {
                sum += f32::cast_from(dout[grad + c]) * f32::cast_from(rows[from + c]);
                c += DOT_UNITS as usize;
            }
        }
        let mut scratch = SharedMemory::<f32>::new(cfg.slots as usize);
        let total = row_sum(sum, &mut scratch, DOT_UNITS, cfg.slots, cfg.reduce);
        if unit == 0 {
            dweights[slot] = F::cast_from(total);
        }
    }
}
