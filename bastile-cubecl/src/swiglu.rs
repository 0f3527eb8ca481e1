//! SwiGLU, fused forward and backward: `out = silu(gate) · up`.
//!
//! Matches HF transformers' eager `act_fn(gate_proj(x)) * up_proj(x)` in
//! the input dtype: `a = cast(silu(g))`, `out = cast(a · u)`. Backward
//! recomputes the sigmoid from `gate` (nothing else is saved):
//! `du = cast(dout · a)`, `dg = cast(cast(dout · u) · s · (1 + g · (1 − s)))`
//! with `s = sigmoid(g)`. Arithmetic is f32; the casts are where the eager
//! reference stores an intermediate in the input dtype.
//!
//! Gate and up come either as two matrices or as one matrix whose rows hold
//! the gate half then the up half (the output of one fused gate+up
//! projection), so no split copy is made; gradients come back in either form,
//! or over the input itself.

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::elementwise::{Tile, TileLaunch, round_through, sigmoid, tile_item};
use crate::glu::{self, Activation, GluShape, Packing};
use crate::rows::Rows;
use crate::tune::same_buffers;
use crate::{FloatDtype, KernelError};

/// `rows` rows of `inter` gate and `inter` up elements.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SwiGluProblem {
    pub rows: usize,
    pub inter: usize,
    pub dtype: FloatDtype,
    /// A number every row stride of the launch is a multiple of (bounds
    /// the vector width); `inter` for dense matrices.
    pub stride_multiple: usize,
}

impl SwiGluProblem {
    fn shape(&self) -> GluShape {
        GluShape {
            activation: Activation::SwiGlu,
            rows: self.rows,
            inter: self.inter,
            dtype: self.dtype,
            stride_multiple: self.stride_multiple,
        }
    }
}

/// Gate and up values (or their gradients).
#[derive(Clone, Debug)]
pub enum GluPair {
    /// Two `rows × inter` matrices.
    Separate { gate: Rows, up: Rows },
    /// One `rows × 2·inter` matrix: gate in columns `[0, inter)`, up in
    /// `[inter, 2·inter)`.
    Packed(Rows),
}

/// A pair as kernel arguments: the gate tensor, the up tensor (a dummy when
/// packed) and both row strides in vectors.
struct PairArgs<R: Runtime> {
    gate: TensorArg<R>,
    up: TensorArg<R>,
    gate_stride: usize,
    up_stride: usize,
}

impl GluPair {
    fn packed(&self) -> bool {
        matches!(self, GluPair::Packed(_))
    }

    /// Each matrix holds `rows` rows of its width, strides a multiple of
    /// the vector width `v`.
    fn check(&self, what: &str, p: &SwiGluProblem, v: usize) -> Result<(), KernelError> {
        let (rows, inter, dtype) = (p.rows, p.inter, p.dtype);
        match self {
            GluPair::Separate { gate, up } => {
                gate.check(&format!("SwiGLU {what} gate"), rows, inter, v, dtype)?;
                up.check(&format!("SwiGLU {what} up"), rows, inter, v, dtype)
            }
            GluPair::Packed(both) => {
                both.check(&format!("SwiGLU {what}"), rows, 2 * inter, v, dtype)
            }
        }
    }

    fn args<R: Runtime>(
        &self,
        rows: usize,
        inter: usize,
        vector_size: usize,
        dummy: &Handle,
    ) -> PairArgs<R> {
        match self {
            GluPair::Separate { gate, up } => PairArgs {
                gate: gate.arg(rows, inter),
                up: up.arg(rows, inter),
                gate_stride: gate.stride_vecs(vector_size),
                up_stride: up.stride_vecs(vector_size),
            },
            GluPair::Packed(both) => PairArgs {
                gate: both.arg(rows, 2 * inter),
                up: Rows::dense(dummy.clone(), vector_size).arg(1, vector_size),
                gate_stride: both.stride_vecs(vector_size),
                up_stride: 0,
            },
        }
    }
}

/// Forward buffers: `out` is `rows × inter`.
#[derive(Clone, Debug)]
pub struct SwiGluForwardBuffers {
    pub input: GluPair,
    pub out: Rows,
}

impl SwiGluForwardBuffers {
    /// Each buffer holds what the forward reads and writes, row strides a
    /// multiple of `v`.
    fn check(&self, p: &SwiGluProblem, v: usize) -> Result<(), KernelError> {
        self.input.check("input", p, v)?;
        self.out.check("SwiGLU out", p.rows, p.inter, v, p.dtype)
    }
}

/// Backward buffers: `grad` receives d_gate and d_up, packed or not
/// independently of the input. With `grad: None` they are written over the
/// input, each where its value was read (by the unit that read it), in
/// the input's layout: the caller saves two `rows × inter` matrices when
/// the activations are not needed after their backward.
#[derive(Clone, Debug)]
pub struct SwiGluBackwardBuffers {
    pub input: GluPair,
    pub dout: Rows,
    pub grad: Option<GluPair>,
}

impl SwiGluBackwardBuffers {
    /// Each buffer holds what the backward reads and writes, row strides a
    /// multiple of `v`.
    fn check(&self, p: &SwiGluProblem, v: usize) -> Result<(), KernelError> {
        self.input.check("input", p, v)?;
        if let Some(grad) = &self.grad {
            grad.check("gradient", p, v)?;
        }
        self.dout.check("SwiGLU dout", p.rows, p.inter, v, p.dtype)
    }

    /// Whether the gradients come packed.
    fn packed_grad(&self) -> bool {
        self.grad.as_ref().unwrap_or(&self.input).packed()
    }

    /// What a benchmark run of an in-place launch writes over: scratch
    /// matrices of the input's layout (its values are not needed to time
    /// it), so tuning leaves the real input intact.
    fn for_benchmark<R: Runtime>(
        client: &ComputeClient<R>,
        p: &SwiGluProblem,
        buffers: &Self,
    ) -> Self {
        if buffers.grad.is_some() {
            return buffers.clone();
        }
        let scratch = |rows: &Rows| Rows {
            handle: client.empty(p.rows * rows.stride * p.dtype.size()),
            stride: rows.stride,
        };
        let input = match &buffers.input {
            GluPair::Separate { gate, up } => GluPair::Separate {
                gate: scratch(gate),
                up: scratch(up),
            },
            GluPair::Packed(both) => GluPair::Packed(scratch(both)),
        };
        Self {
            input,
            ..buffers.clone()
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct GluConfig {
    tile: Tile,
    packed_in: bool,
    packed_grad: bool,
    /// The backward's gradients written over its input.
    in_place: bool,
}

/// Reads the gate and up vectors of one item as f32.
#[cube]
fn load_pair<F: Float, N: Size>(
    gate: &Tensor<Vector<F, N>>,
    up: &Tensor<Vector<F, N>>,
    row: usize,
    col: usize,
    gate_stride: usize,
    up_stride: usize,
    #[comptime] row_items: u32,
    #[comptime] packed: bool,
) -> (Vector<f32, N>, Vector<f32, N>) {
    let g = Vector::<f32, N>::cast_from(gate[row * gate_stride + col]);
    let u = if comptime![packed] {
        Vector::<f32, N>::cast_from(gate[row * gate_stride + row_items as usize + col])
    } else {
        Vector::<f32, N>::cast_from(up[row * up_stride + col])
    };
    (g, u)
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn swiglu_forward_kernel<F: Float, N: Size>(
    gate: &Tensor<Vector<F, N>>,
    up: &Tensor<Vector<F, N>>,
    out: &mut Tensor<Vector<F, N>>,
    rows: usize,
    gate_stride: usize,
    up_stride: usize,
    out_stride: usize,
    #[comptime] cfg: GluConfig,
    #[define(F)] _dtype: StorageType,
) {
    #[unroll]
    for k in 0..cfg.tile.items_per_unit as usize {
        let item = tile_item(k, cfg.tile);
        let row = item / cfg.tile.row_items as usize;
        if row < rows {
            let col = item % cfg.tile.row_items as usize;
            let (g, u) = load_pair::<F, N>(
                gate,
                up,
                row,
                col,
                gate_stride,
                up_stride,
                cfg.tile.row_items,
                cfg.packed_in,
            );
            let a = round_through::<F, N>(g * sigmoid(g));
            out[row * out_stride + col] = Vector::cast_from(a * u);
        }
    }
}

/// Writes d_gate and d_up of one item (`packed`: both into `dgate`).
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_grads<F: Float, N: Size>(
    dgate: &mut Tensor<Vector<F, N>>,
    dup: &mut Tensor<Vector<F, N>>,
    row: usize,
    col: usize,
    dgate_stride: usize,
    dup_stride: usize,
    grads: (Vector<f32, N>, Vector<f32, N>),
    #[comptime] row_items: u32,
    #[comptime] packed: bool,
) {
    let (dg, du) = grads;
    dgate[row * dgate_stride + col] = Vector::cast_from(dg);
    if comptime![packed] {
        dgate[row * dgate_stride + row_items as usize + col] = Vector::cast_from(du);
    } else {
        dup[row * dup_stride + col] = Vector::cast_from(du);
    }
}

/// With `cfg.in_place` the gradients go over `gate` and `up` (each unit
/// writes the items it read, through the same binding: no aliased
/// bindings) and `dgate`, `dup` are unused.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn swiglu_backward_kernel<F: Float, N: Size>(
    gate: &mut Tensor<Vector<F, N>>,
    up: &mut Tensor<Vector<F, N>>,
    dout: &Tensor<Vector<F, N>>,
    dgate: &mut Tensor<Vector<F, N>>,
    dup: &mut Tensor<Vector<F, N>>,
    rows: usize,
    gate_stride: usize,
    up_stride: usize,
    dout_stride: usize,
    dgate_stride: usize,
    dup_stride: usize,
    #[comptime] cfg: GluConfig,
    #[define(F)] _dtype: StorageType,
) {
    #[unroll]
    for k in 0..cfg.tile.items_per_unit as usize {
        let item = tile_item(k, cfg.tile);
        let row = item / cfg.tile.row_items as usize;
        if row < rows {
            let col = item % cfg.tile.row_items as usize;
            let (g, u) = load_pair::<F, N>(
                gate,
                up,
                row,
                col,
                gate_stride,
                up_stride,
                cfg.tile.row_items,
                cfg.packed_in,
            );
            let d = Vector::<f32, N>::cast_from(dout[row * dout_stride + col]);
            let one = Vector::<f32, N>::new(1.0);
            let s = sigmoid(g);
            let a = round_through::<F, N>(g * s);
            let da = round_through::<F, N>(d * u);
            let grads = (da * s * (one + g * (one - s)), d * a);
            if comptime![cfg.in_place] {
                store_grads::<F, N>(
                    gate,
                    up,
                    row,
                    col,
                    gate_stride,
                    up_stride,
                    grads,
                    cfg.tile.row_items,
                    cfg.packed_in,
                );
            } else {
                store_grads::<F, N>(
                    dgate,
                    dup,
                    row,
                    col,
                    dgate_stride,
                    dup_stride,
                    grads,
                    cfg.tile.row_items,
                    cfg.packed_grad,
                );
            }
        }
    }
}

/// Launches the forward kernel with one explicit configuration.
pub fn forward_with<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &SwiGluProblem,
    buffers: &SwiGluForwardBuffers,
    config: &TileLaunch,
) -> Result<(), KernelError> {
    let Some((v, row_items)) = problem.shape().tile(client, config)? else {
        return Ok(());
    };
    buffers.check(problem, v)?;
    let dummy = client.empty(16);
    let input = buffers
        .input
        .args::<R>(problem.rows, problem.inter, v, &dummy);
    let cfg = GluConfig {
        tile: config.tile(row_items),
        packed_in: buffers.input.packed(),
        packed_grad: false,
        in_place: false,
    };
    unsafe {
        swiglu_forward_kernel::launch_unchecked::<R>(
            client,
            config.cube_count(client, problem.rows * row_items)?,
            config.cube_dim(),
            v,
            input.gate,
            input.up,
            buffers.out.arg(problem.rows, problem.inter),
            problem.rows,
            input.gate_stride,
            input.up_stride,
            buffers.out.stride_vecs(v),
            cfg,
            problem.dtype.storage(),
        )
    }
    Ok(())
}

/// Launches the backward kernel with one explicit configuration.
pub fn backward_with<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &SwiGluProblem,
    buffers: &SwiGluBackwardBuffers,
    config: &TileLaunch,
) -> Result<(), KernelError> {
    let Some((v, row_items)) = problem.shape().tile(client, config)? else {
        return Ok(());
    };
    buffers.check(problem, v)?;
    // Distinct placeholders for unused bindings: a buffer bound twice
    // with write access is an aliasing error on some runtimes.
    let dummy = || client.empty(16);
    let (dummy_in, dummy_out) = (dummy(), dummy());
    let input = buffers
        .input
        .args::<R>(problem.rows, problem.inter, v, &dummy_in);
    let grad = match &buffers.grad {
        Some(grad) => grad.args::<R>(problem.rows, problem.inter, v, &dummy_out),
        None => {
            let unused = |h: Handle| Rows::dense(h, v).arg(1, v);
            PairArgs {
                gate: unused(dummy_out.clone()),
                up: unused(dummy()),
                gate_stride: 0,
                up_stride: 0,
            }
        }
    };
    let cfg = GluConfig {
        tile: config.tile(row_items),
        packed_in: buffers.input.packed(),
        packed_grad: buffers.packed_grad(),
        in_place: buffers.grad.is_none(),
    };
    unsafe {
        swiglu_backward_kernel::launch_unchecked::<R>(
            client,
            config.cube_count(client, problem.rows * row_items)?,
            config.cube_dim(),
            v,
            input.gate,
            input.up,
            buffers.dout.arg(problem.rows, problem.inter),
            grad.gate,
            grad.up,
            problem.rows,
            input.gate_stride,
            input.up_stride,
            buffers.dout.stride_vecs(v),
            grad.gate_stride,
            grad.up_stride,
            cfg,
            problem.dtype.storage(),
        )
    }
    Ok(())
}

/// Every configuration worth trying for `problem` on this device.
pub fn candidates<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &SwiGluProblem,
) -> Vec<TileLaunch> {
    problem.shape().candidates(client)
}

/// Runs the forward kernel with the autotuned configuration.
pub fn forward<R: Runtime>(
    client: &ComputeClient<R>,
    device: &R::Device,
    problem: &SwiGluProblem,
    buffers: &SwiGluForwardBuffers,
) -> Result<(), KernelError> {
    problem.shape().validate()?;
    buffers.check(problem, 1)?;
    let packing = Packing {
        input: buffers.input.packed(),
        grad: false,
        in_place: false,
    };
    let shape = problem.shape();
    glu::run(
        shape,
        packing,
        false,
        forward_with::<R>,
        same_buffers,
        client,
        device,
        problem,
        buffers,
    )
}

/// Runs the backward kernel with the autotuned configuration.
pub fn backward<R: Runtime>(
    client: &ComputeClient<R>,
    device: &R::Device,
    problem: &SwiGluProblem,
    buffers: &SwiGluBackwardBuffers,
) -> Result<(), KernelError> {
    problem.shape().validate()?;
    buffers.check(problem, 1)?;
    let packing = Packing {
        input: buffers.input.packed(),
        grad: buffers.packed_grad(),
        in_place: buffers.grad.is_none(),
    };
    let shape = problem.shape();
    glu::run(
        shape,
        packing,
        true,
        backward_with::<R>,
        SwiGluBackwardBuffers::for_benchmark::<R>,
        client,
        device,
        problem,
        buffers,
    )
}
