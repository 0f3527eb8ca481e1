//! GPT-OSS expert activation (clamped GEGLU), fused forward and backward.
//!
//! The input holds gate and up **interleaved** (`[..., ::2]` gate,
//! `[..., 1::2]` up). Matching HF transformers' `GptOssExperts` in the input
//! dtype (each `cast` is where the eager code stores an intermediate):
//!
//! ```text
//! g = min(gate, limit)            u = clamp(up, -limit, limit)
//! z = cast(α·g)   s = cast(σ(z))   glu = cast(g·s)   u1 = cast(u + 1)
//! out = cast(u1 · glu)
//! ```
//!
//! Backward (autograd of the same graph): `du1 = cast(d·glu)`,
//! `dglu = cast(d·u1)`, `dg = cast(cast(dglu·s) + cast(cast(cast(dglu·g)·s·(1−s))·α))`,
//! then the clamps: `d_gate = dg` where `gate ≤ limit`, else 0;
//! `d_up = du1` where `−limit ≤ up ≤ limit`, else 0 (torch.clamp's rule:
//! the gradient passes at exactly ±limit).

use cubecl::prelude::*;

use crate::elementwise::{Tile, TileLaunch, tile_item};
use crate::glu::{self, Activation, GluShape, Packing};
use crate::rows::Rows;
use crate::{FloatDtype, KernelError};

/// `rows` rows of `inter` interleaved (gate, up) pairs, i.e. `2·inter`
/// input elements and `inter` output elements per row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GegluProblem {
    pub rows: usize,
    pub inter: usize,
    pub alpha: f32,
    pub limit: f32,
    pub dtype: FloatDtype,
    /// A number every row stride of the launch is a multiple of.
    pub stride_multiple: usize,
}

impl GegluProblem {
    fn shape(&self) -> GluShape {
        GluShape {
            activation: Activation::GegluOss,
            rows: self.rows,
            inter: self.inter,
            dtype: self.dtype,
            stride_multiple: self.stride_multiple,
        }
    }

    fn validate(&self) -> Result<(), KernelError> {
        if !(self.alpha.is_finite() && self.limit.is_finite() && self.limit >= 0.0) {
            return Err(KernelError::Shape(format!(
                "GEGLU needs a finite alpha and a finite non-negative limit, got {self:?}"
            )));
        }
        Ok(())
    }
}

/// Forward buffers: `input` is `rows × 2·inter`, `out` `rows × inter`.
#[derive(Clone, Debug)]
pub struct GegluForwardBuffers {
    pub input: Rows,
    pub out: Rows,
}

impl GegluForwardBuffers {
    /// Each buffer holds what the forward reads and writes, row strides a
    /// multiple of `v`.
    fn check(&self, p: &GegluProblem, v: usize) -> Result<(), KernelError> {
        let (rows, inter, dtype) = (p.rows, p.inter, p.dtype);
        self.input.check("GEGLU input", rows, 2 * inter, v, dtype)?;
        self.out.check("GEGLU out", rows, inter, v, dtype)
    }
}

/// Backward buffers: `dout` is `rows × inter`, `dinput` `rows × 2·inter`.
#[derive(Clone, Debug)]
pub struct GegluBackwardBuffers {
    pub input: Rows,
    pub dout: Rows,
    pub dinput: Rows,
}

impl GegluBackwardBuffers {
    /// Each buffer holds what the backward reads and writes, row strides a
    /// multiple of `v`.
    fn check(&self, p: &GegluProblem, v: usize) -> Result<(), KernelError> {
        let (rows, inter, dtype) = (p.rows, p.inter, p.dtype);
        self.input.check("GEGLU input", rows, 2 * inter, v, dtype)?;
        self.dout.check("GEGLU dout", rows, inter, v, dtype)?;
        self.dinput.check("GEGLU dinput", rows, 2 * inter, v, dtype)
    }
}

/// Loads the `2·N` interleaved input elements of one item as f32.
#[cube]
fn load_span<F: Float, N: Size>(input: &Tensor<Vector<F, N>>, at: usize) -> Array<f32> {
    let n = N::value();
    let mut span = Array::<f32>::new(comptime![2 * n]);
    let v0 = input[at];
    let v1 = input[at + 1];
    #[unroll]
    for l in 0..n {
        span[l] = f32::cast_from(v0[l]);
        span[n + l] = f32::cast_from(v1[l]);
    }
    span
}

/// Rounds one f32 through `F`.
#[cube]
fn round1<F: Float>(x: f32) -> f32 {
    f32::cast_from(F::cast_from(x))
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn geglu_forward_kernel<F: Float, N: Size>(
    input: &Tensor<Vector<F, N>>,
    out: &mut Tensor<Vector<F, N>>,
    rows: usize,
    in_stride: usize,
    out_stride: usize,
    alpha: f32,
    limit: f32,
    #[comptime] tile: Tile,
    #[define(F)] _dtype: StorageType,
) {
    let n = N::value();
    #[unroll]
    for k in 0..tile.items_per_unit as usize {
        let item = tile_item(k, tile);
        let row = item / tile.row_items as usize;
        if row < rows {
            let col = item % tile.row_items as usize;
            let span = load_span::<F, N>(input, row * in_stride + 2 * col);
            let mut o = Vector::<f32, N>::new(0.0);
            #[unroll]
            for j in 0..n {
                let g0 = span[2 * j];
                let u0 = span[2 * j + 1];
                let g = select(g0 > limit, limit, g0);
                let u = select(u0 > limit, limit, select(u0 < -limit, -limit, u0));
                let z = round1::<F>(alpha * g);
                let s = round1::<F>(1.0f32 / (1.0f32 + f32::exp(-z)));
                let glu = round1::<F>(g * s);
                o[j] = round1::<F>(u + 1.0f32) * glu;
            }
            out[row * out_stride + col] = Vector::cast_from(o);
        }
    }
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn geglu_backward_kernel<F: Float, N: Size>(
    input: &Tensor<Vector<F, N>>,
    dout: &Tensor<Vector<F, N>>,
    dinput: &mut Tensor<Vector<F, N>>,
    rows: usize,
    in_stride: usize,
    dout_stride: usize,
    dinput_stride: usize,
    alpha: f32,
    limit: f32,
    #[comptime] tile: Tile,
    #[define(F)] _dtype: StorageType,
) {
    let n = N::value();
    #[unroll]
    for k in 0..tile.items_per_unit as usize {
        let item = tile_item(k, tile);
        let row = item / tile.row_items as usize;
        if row < rows {
            let col = item % tile.row_items as usize;
            let span = load_span::<F, N>(input, row * in_stride + 2 * col);
            let d = Vector::<f32, N>::cast_from(dout[row * dout_stride + col]);
            let mut grads = Array::<f32>::new(comptime![2 * n]);
            #[unroll]
            for j in 0..n {
                let g0 = span[2 * j];
                let u0 = span[2 * j + 1];
                let g = select(g0 > limit, limit, g0);
                let u = select(u0 > limit, limit, select(u0 < -limit, -limit, u0));
                let z = round1::<F>(alpha * g);
                let s = round1::<F>(1.0f32 / (1.0f32 + f32::exp(-z)));
                let glu = round1::<F>(g * s);
                let u1 = round1::<F>(u + 1.0f32);
                let dj = d[j];
                let du1 = round1::<F>(dj * glu);
                let dglu = round1::<F>(dj * u1);
                let ds = round1::<F>(dglu * g);
                let dz = round1::<F>(ds * s * (1.0f32 - s));
                let dg = round1::<F>(round1::<F>(dglu * s) + round1::<F>(dz * alpha));
                // torch.clamp passes the gradient where min <= x <= max.
                grads[2 * j] = select(g0 <= limit, dg, 0.0f32);
                grads[2 * j + 1] = select(u0 >= -limit && u0 <= limit, du1, 0.0f32);
            }
            let mut w0 = Vector::<f32, N>::new(0.0);
            let mut w1 = Vector::<f32, N>::new(0.0);
            #[unroll]
            for l in 0..n {
                w0[l] = grads[l];
                w1[l] = grads[n + l];
            }
            let at = row * dinput_stride + 2 * col;
            dinput[at] = Vector::cast_from(w0);
            dinput[at + 1] = Vector::cast_from(w1);
        }
    }
}

/// Launches the forward kernel with one explicit configuration.
pub fn forward_with<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &GegluProblem,
    buffers: &GegluForwardBuffers,
    config: &TileLaunch,
) -> Result<(), KernelError> {
    problem.validate()?;
    let Some((v, row_items)) = problem.shape().tile(client, config)? else {
        return Ok(());
    };
    buffers.check(problem, v)?;
    unsafe {
        geglu_forward_kernel::launch_unchecked::<R>(
            client,
            config.cube_count(client, problem.rows * row_items)?,
            config.cube_dim(),
            v,
            buffers.input.arg(problem.rows, 2 * problem.inter),
            buffers.out.arg(problem.rows, problem.inter),
            problem.rows,
            buffers.input.stride_vecs(v),
            buffers.out.stride_vecs(v),
            problem.alpha,
            problem.limit,
            config.tile(row_items),
            problem.dtype.storage(),
        )
    }
    Ok(())
}

/// Launches the backward kernel with one explicit configuration.
pub fn backward_with<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &GegluProblem,
    buffers: &GegluBackwardBuffers,
    config: &TileLaunch,
) -> Result<(), KernelError> {
    problem.validate()?;
    let Some((v, row_items)) = problem.shape().tile(client, config)? else {
        return Ok(());
    };
    buffers.check(problem, v)?;
    unsafe {
        geglu_backward_kernel::launch_unchecked::<R>(
            client,
            config.cube_count(client, problem.rows * row_items)?,
            config.cube_dim(),
            v,
            buffers.input.arg(problem.rows, 2 * problem.inter),
            buffers.dout.arg(problem.rows, problem.inter),
            buffers.dinput.arg(problem.rows, 2 * problem.inter),
            problem.rows,
            buffers.input.stride_vecs(v),
            buffers.dout.stride_vecs(v),
            buffers.dinput.stride_vecs(v),
            problem.alpha,
            problem.limit,
            config.tile(row_items),
            problem.dtype.storage(),
        )
    }
    Ok(())
}

/// Every configuration worth trying for `problem` on this device.
pub fn candidates<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &GegluProblem,
) -> Vec<TileLaunch> {
    problem.shape().candidates(client)
}

/// Runs the forward (or, with `backward`, the backward) kernel with the
/// autotuned configuration.
fn tuned<R: Runtime, Buffers: Clone + Send + Sync + 'static>(
    backward: bool,
    launch: crate::tune::Launcher<R, GegluProblem, Buffers, TileLaunch>,
    client: &ComputeClient<R>,
    device: &R::Device,
    problem: &GegluProblem,
    buffers: &Buffers,
) -> Result<(), KernelError> {
    problem.validate()?;
    let packing = Packing {
        input: false,
        grad: false,
        in_place: false,
    };
    let shape = problem.shape();
    glu::run(
        shape,
        packing,
        backward,
        launch,
        crate::tune::same_buffers,
        client,
        device,
        problem,
        buffers,
    )
}

/// Runs the forward kernel with the autotuned configuration.
pub fn forward<R: Runtime>(
    client: &ComputeClient<R>,
    device: &R::Device,
    problem: &GegluProblem,
    buffers: &GegluForwardBuffers,
) -> Result<(), KernelError> {
    problem.validate()?;
    buffers.check(problem, 1)?;
    tuned(false, forward_with::<R>, client, device, problem, buffers)
}

/// Runs the backward kernel with the autotuned configuration.
pub fn backward<R: Runtime>(
    client: &ComputeClient<R>,
    device: &R::Device,
    problem: &GegluProblem,
    buffers: &GegluBackwardBuffers,
) -> Result<(), KernelError> {
    problem.validate()?;
    buffers.check(problem, 1)?;
    tuned(true, backward_with::<R>, client, device, problem, buffers)
}
