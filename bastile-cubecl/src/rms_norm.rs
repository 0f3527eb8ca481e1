//! RMSNorm, fused forward and backward.
//!
//! Forward, per row of `hidden` elements:
//! `rstd = 1 / sqrt(mean(x32²) + eps)`, `n = x32 · rstd`, then either
//! `y = γ · cast(n)` ([`RmsNormCast::Llama`], Qwen3 / Llama) or
//! `y = cast(γ · n)` ([`RmsNormCast::GptOss`]). The statistics are f32
//! whatever the input dtype and `rstd` is saved for the backward pass.
//!
//! Backward, one pass over `x` and `dy`:
//! `dn = dy · γ`, `dx = rstd · (dn − n · mean(dn · n))`, and `dγ = Σ_rows dy · n`
//! (with `n` rounded to the input dtype under the Llama convention, as the
//! reference computes it). `dγ` is reduced in two deterministic f32 stages:
//! each cube of a persistent grid accumulates its rows in registers and
//! writes one partial row, then [`crate::reduce::column_sum`] adds the
//! partials.
//!
//! Each row is held in registers between the reduction and the output pass,
//! so `x` (and `dy`) are read from memory exactly once.

use std::sync::Arc;

use cubecl::prelude::*;
use cubecl::server::Handle;
use cubecl::tune::{LocalTuner, local_tuner};

use crate::elementwise::round_through;
use crate::launch::gcd;
use crate::reduce::{RowReduce, column_sum, lane_sum, row_sum, row_sum_scratch};
pub use crate::rows::Rows;
use crate::rows::tensor_arg;
use crate::tune::{CandidateCache, Launcher, Tuner, run_tuned};
use crate::{FloatDtype, KernelError, launch};

/// Where the cast back to the input dtype happens relative to the γ multiply.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
pub enum RmsNormCast {
    /// `γ · cast(x·rstd)`: Qwen3, Llama (HF `LlamaRMSNorm`).
    #[default]
    Llama,
    /// `cast(γ · x·rstd)`: GPT-OSS (HF `GptOssRMSNorm`).
    GptOss,
}

/// The problem a launch solves: `rows` rows of `hidden` contiguous elements.
/// Consecutive rows of each matrix may be further apart than `hidden`
/// (padded pitches, as CubeCL's optimized layouts allocate them): see
/// [`Rows`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RmsNormProblem {
    pub rows: usize,
    pub hidden: usize,
    pub eps: f32,
    pub cast: RmsNormCast,
    pub dtype: FloatDtype,
    /// A number every row stride of the launch is a multiple of (bounds
    /// the vector width); `hidden` for dense matrices.
    pub stride_multiple: usize,
}

impl RmsNormProblem {
    fn validate(&self) -> Result<(), KernelError> {
        if self.hidden == 0 {
            return Err(KernelError::Shape(
                "RMSNorm needs a hidden size of at least 1".into(),
            ));
        }
        if self.stride_multiple == 0 {
            return Err(KernelError::Shape(
                "row strides must be a positive multiple".into(),
            ));
        }
        if !(self.eps.is_finite() && self.eps >= 0.0) {
            return Err(KernelError::Shape(format!(
                "RMSNorm eps must be finite and non-negative, got {}",
                self.eps
            )));
        }
        Ok(())
    }
}

/// One launch configuration. `units_per_row` units (a multiple of the plane
/// size) share a row, each holding `vecs_per_unit` vectors of `vector_size`
/// elements in registers; a cube processes `rows_per_cube` rows at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct RmsNormLaunch {
    pub vector_size: usize,
    pub units_per_row: u32,
    pub rows_per_cube: u32,
    pub reduce: RowReduce,
}

/// Comptime parameters of the kernels: every distinct value compiles once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RowConfig {
    pub hidden: u32,
    pub hidden_vecs: u32,
    pub units_per_row: u32,
    pub vecs_per_unit: u32,
    pub rows_per_cube: u32,
    pub slots_per_row: u32,
    pub reduce: RowReduce,
    pub gpt_oss_cast: bool,
}

/// Register budget: at most this many vectors per unit and per cached array.
const MAX_VECS_PER_UNIT: usize = 8;
/// Largest cube the candidates use.
const MAX_UNITS_PER_CUBE: u32 = 1024;

impl RmsNormLaunch {
    fn row_config(&self, problem: &RmsNormProblem, plane_min: u32) -> RowConfig {
        let hidden_vecs = problem.hidden / self.vector_size;
        RowConfig {
            hidden: problem.hidden as u32,
            hidden_vecs: hidden_vecs as u32,
            units_per_row: self.units_per_row,
            vecs_per_unit: hidden_vecs.div_ceil(self.units_per_row as usize) as u32,
            rows_per_cube: self.rows_per_cube,
            slots_per_row: match self.reduce {
                RowReduce::Plane => self.units_per_row.div_ceil(plane_min),
                RowReduce::Shared => self.units_per_row,
            },
            reduce: self.reduce,
            gpt_oss_cast: problem.cast == RmsNormCast::GptOss,
        }
    }

    /// Checks the configuration against the problem and the device.
    fn check<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        problem: &RmsNormProblem,
    ) -> Result<RowConfig, KernelError> {
        let planes = launch::plane_sizes(client);
        let unsupported = |why: String| Err(KernelError::Unsupported(why));
        if self.vector_size == 0 || !problem.hidden.is_multiple_of(self.vector_size) {
            return unsupported(format!(
                "vector size {} does not divide hidden {}",
                self.vector_size, problem.hidden
            ));
        }
        if !self.units_per_row.is_power_of_two() || self.rows_per_cube == 0 {
            return unsupported(format!("{self:?} is not a valid row layout"));
        }
        if self.reduce == RowReduce::Plane
            && (!planes.ops || !self.units_per_row.is_multiple_of(planes.max))
        {
            return unsupported(format!(
                "plane reduction over {} units needs plane ops and a multiple of the plane size {}",
                self.units_per_row, planes.max
            ));
        }
        let cfg = self.row_config(problem, planes.min);
        if cfg.vecs_per_unit as usize > MAX_VECS_PER_UNIT {
            return unsupported(format!(
                "{} vectors per unit exceed the register budget",
                cfg.vecs_per_unit
            ));
        }
        let scratch = row_sum_scratch(
            self.reduce,
            self.units_per_row,
            self.rows_per_cube,
            planes.min,
        ) * 4;
        let grad_stage = (cfg.units_per_row * cfg.vecs_per_unit) as usize * self.vector_size * 4;
        launch::check_cube_fits(
            client,
            self.units_per_row * self.rows_per_cube,
            scratch + grad_stage,
        )?;
        Ok(cfg)
    }

    fn cube_dim(&self) -> CubeDim {
        CubeDim::new_2d(self.units_per_row, self.rows_per_cube)
    }
}

/// Loads `vecs_per_unit` vectors of row `row` as f32 (zeros past the row's
/// end or for an invalid row).
#[cube]
fn load_row<F: Float, N: Size>(
    input: &Tensor<Vector<F, N>>,
    row: usize,
    stride: usize,
    valid: bool,
    #[comptime] cfg: RowConfig,
) -> Array<Vector<f32, N>> {
    let mut values = Array::<Vector<f32, N>>::new(cfg.vecs_per_unit as usize);
    let base = row * stride;
    #[unroll]
    for k in 0..cfg.vecs_per_unit as usize {
        let col = UNIT_POS_X as usize + k * cfg.units_per_row as usize;
        let mut v = Vector::<f32, N>::new(0.0);
        if valid && col < cfg.hidden_vecs as usize {
            v = Vector::cast_from(input[base + col]);
        }
        values[k] = v;
    }
    values
}

/// Loads this unit's columns of γ as f32 (zeros past the end).
#[cube]
fn load_gamma<F: Float, N: Size>(
    gamma: &Tensor<Vector<F, N>>,
    #[comptime] cfg: RowConfig,
) -> Array<Vector<f32, N>> {
    load_row::<F, N>(gamma, 0, 0, true, cfg)
}

#[cube(launch_unchecked)]
fn rms_norm_forward_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    gamma: &Tensor<Vector<F, N>>,
    out: &mut Tensor<Vector<F, N>>,
    rstd_out: &mut Tensor<f32>,
    rows: usize,
    x_stride: usize,
    out_stride: usize,
    eps: f32,
    #[comptime] cfg: RowConfig,
    #[define(F)] _dtype: StorageType,
) {
    let row = CUBE_POS * cfg.rows_per_cube as usize + UNIT_POS_Y as usize;
    let valid = row < rows;
    let xs = load_row::<F, N>(x, row, x_stride, valid, cfg);

    let mut sum_sq = Vector::<f32, N>::new(0.0);
    #[unroll]
    for k in 0..cfg.vecs_per_unit as usize {
        sum_sq += xs[k] * xs[k];
    }
    let mut scratch = SharedMemory::<f32>::new((cfg.slots_per_row * cfg.rows_per_cube) as usize);
    let total = row_sum(
        lane_sum(sum_sq),
        &mut scratch,
        cfg.units_per_row,
        cfg.slots_per_row,
        cfg.reduce,
    );
    let rstd = 1.0f32 / f32::sqrt(total / cfg.hidden as f32 + eps);

    if valid {
        let g = load_gamma::<F, N>(gamma, cfg);
        let base = row * out_stride;
        #[unroll]
        for k in 0..cfg.vecs_per_unit as usize {
            let col = UNIT_POS_X as usize + k * cfg.units_per_row as usize;
            if col < cfg.hidden_vecs as usize {
                let n = xs[k] * Vector::new(rstd);
                let y = if comptime![cfg.gpt_oss_cast] {
                    g[k] * n
                } else {
                    g[k] * round_through::<F, N>(n)
                };
                out[base + col] = Vector::cast_from(y);
            }
        }
        if UNIT_POS_X == 0 {
            rstd_out[row] = rstd;
        }
    }
}

#[cube(launch_unchecked)]
fn rms_norm_backward_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    gamma: &Tensor<Vector<F, N>>,
    rstd: &Tensor<f32>,
    dy: &Tensor<Vector<F, N>>,
    dx: &mut Tensor<Vector<F, N>>,
    dgamma_partials: &mut Tensor<Vector<f32, N>>,
    rows: usize,
    x_stride: usize,
    dy_stride: usize,
    dx_stride: usize,
    #[comptime] cfg: RowConfig,
    #[define(F)] _dtype: StorageType,
) {
    let g = load_gamma::<F, N>(gamma, cfg);
    let mut acc = Array::<Vector<f32, N>>::new(cfg.vecs_per_unit as usize);
    #[unroll]
    for k in 0..cfg.vecs_per_unit as usize {
        acc[k] = Vector::new(0.0);
    }
    let mut scratch = SharedMemory::<f32>::new((cfg.slots_per_row * cfg.rows_per_cube) as usize);

    // Persistent grid: the iteration count is the same for every unit of the
    // cube, so the synchronizations inside `row_sum` stay uniform.
    let stride = CUBE_COUNT * cfg.rows_per_cube as usize;
    let iterations = rows.div_ceil(stride);
    for it in 0..iterations {
        let row = it * stride + CUBE_POS * cfg.rows_per_cube as usize + UNIT_POS_Y as usize;
        let valid = row < rows;
        let xs = load_row::<F, N>(x, row, x_stride, valid, cfg);
        let dys = load_row::<F, N>(dy, row, dy_stride, valid, cfg);
        let mut r = 0.0f32;
        if valid {
            r = rstd[row];
        }
        let mut dot = Vector::<f32, N>::new(0.0);
        let mut ns = Array::<Vector<f32, N>>::new(cfg.vecs_per_unit as usize);
        #[unroll]
        for k in 0..cfg.vecs_per_unit as usize {
            let n = xs[k] * Vector::new(r);
            ns[k] = n;
            dot += dys[k] * g[k] * n;
            let n_used = if comptime![cfg.gpt_oss_cast] {
                n
            } else {
                round_through::<F, N>(n)
            };
            acc[k] += dys[k] * n_used;
        }
        let mean_dot = row_sum(
            lane_sum(dot),
            &mut scratch,
            cfg.units_per_row,
            cfg.slots_per_row,
            cfg.reduce,
        ) / cfg.hidden as f32;
        if valid {
            let base = row * dx_stride;
            #[unroll]
            for k in 0..cfg.vecs_per_unit as usize {
                let col = UNIT_POS_X as usize + k * cfg.units_per_row as usize;
                if col < cfg.hidden_vecs as usize {
                    let d = (dys[k] * g[k] - ns[k] * Vector::new(mean_dot)) * Vector::new(r);
                    dx[base + col] = Vector::cast_from(d);
                }
            }
        }
    }

    // Combine the row slots of this cube in shared memory, one slot at a
    // time, then write the cube's partial row of dγ.
    let staged = (cfg.units_per_row * cfg.vecs_per_unit) as usize;
    let mut stage = SharedMemory::<Vector<f32, N>>::new(staged);
    for slot in 0..cfg.rows_per_cube {
        if UNIT_POS_Y == slot {
            #[unroll]
            for k in 0..cfg.vecs_per_unit as usize {
                let i = UNIT_POS_X as usize + k * cfg.units_per_row as usize;
                if slot == 0 {
                    stage[i] = acc[k];
                } else {
                    stage[i] += acc[k];
                }
            }
        }
        sync_cube();
    }
    if UNIT_POS_Y == 0 {
        let base = CUBE_POS * cfg.hidden_vecs as usize;
        #[unroll]
        for k in 0..cfg.vecs_per_unit as usize {
            let col = UNIT_POS_X as usize + k * cfg.units_per_row as usize;
            if col < cfg.hidden_vecs as usize {
                dgamma_partials[base + col] = stage[col];
            }
        }
    }
}

/// The buffers of a forward launch: `x` and `out` hold `rows × hidden`
/// elements of the problem's dtype, `gamma` `hidden`, `rstd` `rows` f32.
#[derive(Clone, Debug)]
pub struct ForwardBuffers {
    pub x: Rows,
    pub gamma: Handle,
    pub out: Rows,
    pub rstd: Handle,
}

impl ForwardBuffers {
    /// Each buffer holds what the forward reads and writes.
    fn check(&self, p: &RmsNormProblem, vector_size: usize) -> Result<(), KernelError> {
        let (rows, hidden, dtype) = (p.rows, p.hidden, p.dtype);
        self.x
            .check("RMSNorm x", rows, hidden, vector_size, dtype)?;
        self.out
            .check("RMSNorm out", rows, hidden, vector_size, dtype)?;
        launch::check_holds("RMSNorm gamma", &self.gamma, hidden, dtype.size())?;
        launch::check_holds("RMSNorm rstd", &self.rstd, rows, 4)
    }
}

/// The buffers of a backward launch. `dgamma` receives `hidden` elements of
/// the problem's dtype.
#[derive(Clone, Debug)]
pub struct BackwardBuffers {
    pub x: Rows,
    pub gamma: Handle,
    pub rstd: Handle,
    pub dy: Rows,
    pub dx: Rows,
    pub dgamma: Handle,
}

impl BackwardBuffers {
    /// Each buffer holds what the backward reads and writes.
    fn check(&self, p: &RmsNormProblem, vector_size: usize) -> Result<(), KernelError> {
        let (rows, hidden, dtype) = (p.rows, p.hidden, p.dtype);
        self.x
            .check("RMSNorm x", rows, hidden, vector_size, dtype)?;
        self.dy
            .check("RMSNorm dy", rows, hidden, vector_size, dtype)?;
        self.dx
            .check("RMSNorm dx", rows, hidden, vector_size, dtype)?;
        launch::check_holds("RMSNorm gamma", &self.gamma, hidden, dtype.size())?;
        launch::check_holds("RMSNorm dgamma", &self.dgamma, hidden, dtype.size())?;
        launch::check_holds("RMSNorm rstd", &self.rstd, rows, 4)
    }
}

/// Launches the forward kernel with one explicit configuration.
pub fn forward_with<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &RmsNormProblem,
    buffers: &ForwardBuffers,
    config: &RmsNormLaunch,
) -> Result<(), KernelError> {
    problem.validate()?;
    let cfg = config.check(client, problem)?;
    buffers.check(problem, config.vector_size)?;
    if problem.rows == 0 {
        return Ok(());
    }
    let cubes = problem.rows.div_ceil(config.rows_per_cube as usize);
    let count = launch::cube_count(client, cubes)?;
    unsafe {
        rms_norm_forward_kernel::launch_unchecked::<R>(
            client,
            count,
            config.cube_dim(),
            config.vector_size,
            buffers.x.arg(problem.rows, problem.hidden),
            tensor_arg(&buffers.gamma, 1, problem.hidden),
            buffers.out.arg(problem.rows, problem.hidden),
            tensor_arg(&buffers.rstd, problem.rows, 1),
            problem.rows,
            buffers.x.stride_vecs(config.vector_size),
            buffers.out.stride_vecs(config.vector_size),
            problem.eps,
            cfg,
            problem.dtype.storage(),
        )
    }
    Ok(())
}

/// Launches the backward kernels (row pass, then the dγ column sum) with one
/// explicit configuration.
pub fn backward_with<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &RmsNormProblem,
    buffers: &BackwardBuffers,
    config: &RmsNormLaunch,
) -> Result<(), KernelError> {
    problem.validate()?;
    let cfg = config.check(client, problem)?;
    buffers.check(problem, config.vector_size)?;
    let row_cubes = problem.rows.div_ceil(config.rows_per_cube as usize);
    // Enough cubes to fill the device a few times over, no more: every cube
    // writes one partial row of dγ that the second stage reads back.
    let cubes = row_cubes.clamp(1, launch::parallel_units(client) * 4);
    let partials = client.empty(cubes * problem.hidden * 4);
    if problem.rows > 0 {
        let count = launch::cube_count(client, cubes)?;
        unsafe {
            rms_norm_backward_kernel::launch_unchecked::<R>(
                client,
                count,
                config.cube_dim(),
                config.vector_size,
                buffers.x.arg(problem.rows, problem.hidden),
                tensor_arg(&buffers.gamma, 1, problem.hidden),
                tensor_arg(&buffers.rstd, problem.rows, 1),
                buffers.dy.arg(problem.rows, problem.hidden),
                buffers.dx.arg(problem.rows, problem.hidden),
                tensor_arg(&partials, cubes, problem.hidden),
                problem.rows,
                buffers.x.stride_vecs(config.vector_size),
                buffers.dy.stride_vecs(config.vector_size),
                buffers.dx.stride_vecs(config.vector_size),
                cfg,
                problem.dtype.storage(),
            )
        }
    }
    let partial_rows = if problem.rows == 0 { 0 } else { cubes };
    column_sum(
        client,
        &partials,
        &buffers.dgamma,
        partial_rows,
        problem.hidden,
        problem.dtype,
    )
}

/// Every configuration worth trying for `problem` on this device, the
/// default heuristic's choice first.
pub fn candidates<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &RmsNormProblem,
) -> Vec<RmsNormLaunch> {
    let planes = launch::plane_sizes(client);
    let vector_size = launch::vector_size(
        client,
        problem.dtype,
        gcd(problem.hidden, problem.stride_multiple),
    );
    let hidden_vecs = problem.hidden / vector_size;
    let max_units = client
        .properties()
        .hardware
        .max_units_per_cube
        .min(MAX_UNITS_PER_CUBE);
    let mut out = Vec::new();
    let mut units = planes.max.next_power_of_two();
    loop {
        let vecs_per_unit = hidden_vecs.div_ceil(units as usize);
        let too_wide = units as usize > hidden_vecs.next_power_of_two().max(planes.max as usize);
        if units > max_units || too_wide {
            break;
        }
        if vecs_per_unit <= MAX_VECS_PER_UNIT {
            for rows_per_cube in [1u32, 2, 4] {
                if units * rows_per_cube > max_units
                    || (rows_per_cube > 1 && units * rows_per_cube > 512)
                {
                    continue;
                }
                for reduce in [RowReduce::Plane, RowReduce::Shared] {
                    let config = RmsNormLaunch {
                        vector_size,
                        units_per_row: units,
                        rows_per_cube,
                        reduce,
                    };
                    if config.check(client, problem).is_ok() {
                        out.push(config);
                    }
                }
            }
        }
        units *= 2;
    }
    // Default first: the narrowest row layout that fits the register budget,
    // with enough rows per cube for about 128 units, plane reduction if any.
    out.sort_by_key(|c| {
        let units = c.units_per_row * c.rows_per_cube;
        (
            c.units_per_row,
            units.abs_diff(128),
            c.reduce == RowReduce::Shared,
        )
    });
    out
}

/// The autotune key: rows bucketed by powers of two, exact hidden size and dtype.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct RmsNormKey {
    pub rows_bucket: usize,
    pub hidden: usize,
    pub dtype: FloatDtype,
    pub cast: RmsNormCast,
    pub vector_size: usize,
    pub backward: bool,
}

impl core::fmt::Display for RmsNormKey {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(
            f,
            "rms_norm{} rows~{} hidden={} {} {:?} vec={}",
            if self.backward { "_bwd" } else { "_fwd" },
            self.rows_bucket,
            self.hidden,
            self.dtype,
            self.cast,
            self.vector_size
        )
    }
}

impl RmsNormKey {
    fn new(problem: &RmsNormProblem, candidates: &[RmsNormLaunch], backward: bool) -> Self {
        Self {
            vector_size: candidates.first().map_or(1, |c| c.vector_size),
            rows_bucket: problem.rows.max(1).next_power_of_two(),
            hidden: problem.hidden,
            dtype: problem.dtype,
            cast: problem.cast,
            backward,
        }
    }
}

static FORWARD_TUNER: Tuner<RmsNormKey> = local_tuner!("bastile-rms-norm-forward");
static BACKWARD_TUNER: Tuner<RmsNormKey> = local_tuner!("bastile-rms-norm-backward");

/// Forgets every tuning decision taken in this process (the on-disk cache
/// is CubeCL's and survives).
pub fn clear_autotune() {
    FORWARD_TUNER.clear();
    BACKWARD_TUNER.clear();
}

/// Candidate lists per device, hidden size, dtype and row alignment.
static CANDIDATES: CandidateCache<(usize, FloatDtype, usize), RmsNormLaunch> =
    CandidateCache::new();

/// [`candidates`], memoized.
fn cached_candidates<R: Runtime>(
    client: &ComputeClient<R>,
    id: &cubecl::CubeTuneId,
    problem: &RmsNormProblem,
) -> Arc<Vec<RmsNormLaunch>> {
    let class = (
        problem.hidden,
        problem.dtype,
        gcd(problem.hidden, problem.stride_multiple),
    );
    CANDIDATES.get(id, class, || candidates(client, problem))
}

/// Whether some launch configuration fits `problem` on this device; cheap
/// after the first call for a row shape (the candidate list is memoized).
pub fn supported<R: Runtime>(
    client: &ComputeClient<R>,
    device: &R::Device,
    problem: &RmsNormProblem,
) -> bool {
    !cached_candidates(client, &cubecl::CubeTuneId::new(client, device), problem).is_empty()
}

fn run<R: Runtime, Buffers: Clone + Send + Sync + 'static>(
    tuner: &'static Tuner<RmsNormKey>,
    backward: bool,
    launch: Launcher<R, RmsNormProblem, Buffers, RmsNormLaunch>,
    client: &ComputeClient<R>,
    device: &R::Device,
    problem: &RmsNormProblem,
    buffers: &Buffers,
) -> Result<(), KernelError> {
    problem.validate()?;
    let id = cubecl::CubeTuneId::new(client, device);
    let candidates = cached_candidates(client, &id, problem);
    let key = RmsNormKey::new(problem, &candidates, backward);
    run_tuned(
        tuner, key, launch, client, &id, problem, buffers, candidates,
    )
}

/// Runs the forward kernel with the configuration autotuned for this
/// (rows, hidden, dtype) on this device.
pub fn forward<R: Runtime>(
    client: &ComputeClient<R>,
    device: &R::Device,
    problem: &RmsNormProblem,
    buffers: &ForwardBuffers,
) -> Result<(), KernelError> {
    problem.validate()?;
    buffers.check(problem, 1)?;
    run(
        &FORWARD_TUNER,
        false,
        forward_with::<R>,
        client,
        device,
        problem,
        buffers,
    )
}

/// Runs the backward kernels with the configuration autotuned for this
/// (rows, hidden, dtype) on this device.
pub fn backward<R: Runtime>(
    client: &ComputeClient<R>,
    device: &R::Device,
    problem: &RmsNormProblem,
    buffers: &BackwardBuffers,
) -> Result<(), KernelError> {
    problem.validate()?;
    buffers.check(problem, 1)?;
    run(
        &BACKWARD_TUNER,
        true,
        backward_with::<R>,
        client,
        device,
        problem,
        buffers,
    )
}
