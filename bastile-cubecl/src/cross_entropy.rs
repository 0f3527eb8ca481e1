//! Cross-entropy over rows of logits: loss, log-sum-exp and the logit
//! gradient in one kernel, never materializing probabilities.
//!
//! Per row `r` with label `y` (all math in f32 whatever the logits dtype):
//!
//! ```text
//! z_j  = x_j, or c · tanh(x_j / c) with a soft cap c
//! lse  = log Σ_j exp(z_j)                       (online max / sum, one read)
//! loss = lse − (1−ε)·z_y − (ε/V)·Σ_j z_j + λ·lse²   (ε: label smoothing, λ: z-loss)
//! dz_j = softmax_j · (1 + 2λ·lse) − ε/V − (1−ε)·[j = y]
//! dx_j = dz_j / cosh²(x_j/c) with a soft cap, else dz_j; times the scale
//! ```
//!
//! Rows whose label is `ignore_index` (or outside `[0, V)`, which the
//! checked API above rejects) have loss 0 and gradient 0. One cube handles
//! one row: a first pass reduces the row's maximum and rescaled exponential
//! sum per unit, the cube combines them, and a second pass writes the
//! gradient, in place over the logits when asked (the fused linear
//! cross-entropy reuses its logits chunk that way). With a given `lse` (the
//! backward pass of a loss whose forward already computed it) only the
//! gradient pass runs; its rows may then be a slice of the vocabulary
//! ([`VocabSlice`]), so that a caller can take the gradient of a few
//! thousand columns of every row at a time.

use std::sync::Arc;

use cubecl::prelude::*;
use cubecl::server::Handle;
use cubecl::tune::{LocalTuner, local_tuner};

use crate::launch::gcd;
use crate::reduce::{RowReduce, lane_sum, row_max, row_sum, row_sum_scratch};
use crate::rows::{Rows, tensor_arg};
use crate::tune::{CandidateCache, Tuner, run_tuned_with};
use crate::{FloatDtype, KernelError, launch};

/// What a launch computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum CrossEntropyMode {
    /// Losses and log-sum-exp only (evaluation, or a forward whose gradient
    /// comes later).
    Stats,
    /// Losses, log-sum-exp and the gradient in one launch.
    StatsAndGrad,
    /// The gradient only, from the log-sum-exp in `lse`.
    Grad,
}

impl CrossEntropyMode {
    fn stats(self) -> bool {
        self != CrossEntropyMode::Grad
    }

    fn grad(self) -> bool {
        self != CrossEntropyMode::Stats
    }
}

/// Where the per-row gradient scale comes from, on top of
/// [`CrossEntropyProblem::scale`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum RowScale {
    /// No device scale.
    None,
    /// One f32 for every row (an upstream scalar gradient).
    Uniform,
    /// One f32 per row (the upstream gradient of per-token losses).
    PerRow,
}

/// Columns `offset .. offset + problem.vocab` of rows of `vocab` logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VocabSlice {
    pub offset: usize,
    pub vocab: usize,
}

/// One cross-entropy launch: `rows` rows of `vocab` logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CrossEntropyProblem {
    pub rows: usize,
    /// The logits per row this launch reads.
    pub vocab: usize,
    /// Where those logits lie in rows of a larger vocabulary, in
    /// [`CrossEntropyMode::Grad`] only (the statistics need whole rows);
    /// `None`: the rows are whole.
    pub slice: Option<VocabSlice>,
    /// The dtype of the logits and of the gradient.
    pub dtype: FloatDtype,
    /// A number every row stride is a multiple of (bounds the vector width).
    pub stride_multiple: usize,
    pub ignore_index: i32,
    /// ε in `[0, 1]`.
    pub label_smoothing: f32,
    /// λ of the `λ·lse²` z-loss term.
    pub z_loss: f32,
    /// The soft cap `c > 0`, if any.
    pub softcap: Option<f32>,
    /// Multiplies every gradient (`1/n` for a mean over `n` tokens).
    pub scale: f32,
    pub mode: CrossEntropyMode,
    pub row_scale: RowScale,
}

impl CrossEntropyProblem {
    fn validate(&self) -> Result<(), KernelError> {
        let bad = |why: String| Err(KernelError::Shape(why));
        if self.vocab == 0 || self.stride_multiple == 0 {
            return bad(format!(
                "cross-entropy needs a positive vocabulary and stride multiple, got {self:?}"
            ));
        }
        if let Some(s) = self.slice {
            if self.mode != CrossEntropyMode::Grad {
                return bad(format!(
                    "a vocabulary slice needs the gradient-only mode, got {:?}",
                    self.mode
                ));
            }
            if s.offset
                .checked_add(self.vocab)
                .is_none_or(|end| end > s.vocab)
            {
                return bad(format!(
                    "columns {}..{} do not lie within a vocabulary of {}",
                    s.offset,
                    s.offset.saturating_add(self.vocab),
                    s.vocab
                ));
            }
        }
        if !(0.0..=1.0).contains(&self.label_smoothing) {
            return bad(format!(
                "label smoothing must lie in [0, 1], got {}",
                self.label_smoothing
            ));
        }
        if !self.z_loss.is_finite() || !self.scale.is_finite() {
            return bad(format!(
                "z-loss and scale must be finite, got {} and {}",
                self.z_loss, self.scale
            ));
        }
        if let Some(c) = self.softcap
            && !(c.is_finite() && c > 0.0)
        {
            return bad(format!("the soft cap must be finite and positive, got {c}"));
        }
        Ok(())
    }

    /// The whole rows' vocabulary and the first column this launch reads.
    fn columns(&self) -> (usize, usize) {
        self.slice.map_or((self.vocab, 0), |s| (s.vocab, s.offset))
    }

    fn vector_size<R: Runtime>(&self, client: &ComputeClient<R>) -> usize {
        launch::vector_size(client, self.dtype, gcd(self.vocab, self.stride_multiple))
    }
}

/// The buffers of a launch.
#[derive(Clone, Debug)]
pub struct CrossEntropyBuffers {
    /// `rows × vocab` logits of the problem's dtype.
    pub logits: Rows,
    /// `rows` i32 labels.
    pub labels: Handle,
    /// Where the gradient goes; `None` overwrites `logits` with it.
    pub grad: Option<Rows>,
    /// `rows` f32 losses, written by the stats modes.
    pub losses: Handle,
    /// `rows` f32 log-sum-exps, written by the stats modes, read by
    /// [`CrossEntropyMode::Grad`].
    pub lse: Handle,
    /// f32 scales: one ([`RowScale::Uniform`]) or `rows` ([`RowScale::PerRow`]).
    pub row_scale: Option<Handle>,
}

/// One launch configuration: `units` units share a row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct CrossEntropyLaunch {
    pub vector_size: usize,
    pub units: u32,
    pub reduce: RowReduce,
}

/// Comptime parameters of the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CeConfig {
    pub units: u32,
    pub slots: u32,
    pub reduce: RowReduce,
    pub stats: bool,
    pub grad: bool,
    pub in_place: bool,
    pub softcap: bool,
    pub smoothing: bool,
    pub row_scale: RowScale,
}

/// Largest lane of a vector.
#[cube]
fn lane_max<N: Size>(v: Vector<f32, N>) -> f32 {
    let mut m = v[0];
    #[unroll]
    for i in 1..v.size() {
        m = select(v[i] > m, v[i], m);
    }
    m
}

/// One vector of logits as f32, soft-capped when the config says so.
#[cube]
fn load_logits<F: Float, N: Size>(
    logits: &Tensor<Vector<F, N>>,
    at: usize,
    cap: f32,
    #[comptime] softcap: bool,
) -> Vector<f32, N> {
    soft_cap(Vector::cast_from(logits[at]), cap, softcap)
}

/// `c · tanh(x / c)`, or `x` without a cap.
#[cube]
fn soft_cap<N: Size>(x: Vector<f32, N>, cap: f32, #[comptime] softcap: bool) -> Vector<f32, N> {
    if comptime![softcap] {
        let c: Vector<f32, N> = Vector::new(cap);
        c * (x / c).tanh()
    } else {
        x
    }
}

/// The label's logit `z_y` (soft-capped), read from its vector.
#[cube]
fn label_logit<F: Float, N: Size>(
    logits: &Tensor<Vector<F, N>>,
    base: usize,
    label: usize,
    cap: f32,
    #[comptime] softcap: bool,
) -> f32 {
    let n = N::value();
    let v = load_logits::<F, N>(logits, base + label / n, cap, softcap);
    let lane = label % n;
    let mut z = 0.0f32;
    #[unroll]
    for l in 0..n {
        z = select(l == lane, v[l], z);
    }
    z
}

#[cube(launch_unchecked)]
fn cross_entropy_kernel<F: Float, N: Size>(
    logits: &mut Tensor<Vector<F, N>>,
    grad: &mut Tensor<Vector<F, N>>,
    labels: &Tensor<i32>,
    losses: &mut Tensor<f32>,
    lse_buf: &mut Tensor<f32>,
    row_scale: &Tensor<f32>,
    rows: usize,
    vocab_vecs: usize,
    row_vocab: usize,
    first_col: usize,
    logits_stride: usize,
    grad_stride: usize,
    ignore_index: i32,
    smoothing: f32,
    z_coef: f32,
    cap: f32,
    scale: f32,
    #[comptime] cfg: CeConfig,
    #[define(F)] _dtype: StorageType,
) {
    let n = N::value();
    let row = CUBE_POS;
    let valid_row = row < rows;
    let vocab = vocab_vecs * n;
    let mut label = ignore_index;
    if valid_row {
        label = labels[row];
    }
    // The row counts when its label is a class of the whole row (of
    // `row_vocab` logits, of which this launch reads `vocab` from
    // `first_col`); anything else (the ignore index, or an out-of-range
    // label the checked API rejected) is skipped.
    let active =
        valid_row && label != ignore_index && label >= 0 && usize::cast_from(label) < row_vocab;
    let label_here = active
        && usize::cast_from(label) >= first_col
        && usize::cast_from(label) < first_col + vocab;
    let label_col = select(label_here, usize::cast_from(label) - first_col, 0usize);
    let base = row * logits_stride;
    let units = cfg.units as usize;
    let iterations = vocab_vecs.div_ceil(units);
    let mut scratch = SharedMemory::<f32>::new(cfg.slots as usize);

    let mut lse = 0.0f32;
    if comptime![cfg.stats] {
        // Online softmax statistics of this unit's columns: the running
        // maximum `m` and the sum of exp(z − m).
        let mut m = comptime![f32::MIN].runtime();
        let mut s = 0.0f32;
        let mut sum_z = 0.0f32;
        for k in 0..iterations {
            let col = UNIT_POS_X as usize + k * units;
            if valid_row && col < vocab_vecs {
                let z = load_logits::<F, N>(logits, base + col, cap, cfg.softcap);
                let vm = lane_max(z);
                let m_new = select(vm > m, vm, m);
                s = s * f32::exp(m - m_new) + lane_sum((z - Vector::new(m_new)).exp());
                m = m_new;
                if comptime![cfg.smoothing] {
                    sum_z += lane_sum(z);
                }
            }
        }
        // Read before the reductions' barriers: after them other units may
        // overwrite the logits with gradients.
        let mut z_label = 0.0f32;
        if UNIT_POS_X == 0 && label_here {
            z_label = label_logit::<F, N>(logits, base, label_col, cap, cfg.softcap);
        }
        let row_m = row_max(m, &mut scratch, cfg.units, cfg.slots, cfg.reduce);
        let row_s = row_sum(
            s * f32::exp(m - row_m),
            &mut scratch,
            cfg.units,
            cfg.slots,
            cfg.reduce,
        );
        lse = row_m + f32::ln(row_s);
        let mut total_z = 0.0f32;
        if comptime![cfg.smoothing] {
            total_z = row_sum(sum_z, &mut scratch, cfg.units, cfg.slots, cfg.reduce);
        }
        if UNIT_POS_X == 0 && valid_row {
            let mut loss = 0.0f32;
            if active {
                loss = lse
                    - (1.0f32 - smoothing) * z_label
                    - smoothing / f32::cast_from(row_vocab) * total_z
                    + z_coef * lse * lse;
            }
            losses[row] = loss;
            lse_buf[row] = lse;
        }
    } else if valid_row {
        lse = lse_buf[row];
    }

    if comptime![cfg.grad] {
        let mut g_scale = scale;
        if comptime![cfg.row_scale == RowScale::PerRow] {
            if valid_row {
                g_scale *= row_scale[row];
            }
        } else if comptime![cfg.row_scale == RowScale::Uniform] {
            g_scale *= row_scale[0];
        }
        g_scale = select(active, g_scale, 0.0f32);
        let p_coef: Vector<f32, N> = Vector::new(1.0f32 + 2.0f32 * z_coef * lse);
        let uniform: Vector<f32, N> = Vector::new(smoothing / f32::cast_from(row_vocab));
        let target = 1.0f32 - smoothing;
        let lse_v: Vector<f32, N> = Vector::new(lse);
        let gbase = row * grad_stride;
        for k in 0..iterations {
            let col = UNIT_POS_X as usize + k * units;
            if valid_row && col < vocab_vecs {
                let x = Vector::<f32, N>::cast_from(logits[base + col]);
                let z = soft_cap(x, cap, cfg.softcap);
                let mut d = (z - lse_v).exp() * p_coef - uniform;
                if label_here && col == label_col / n {
                    #[unroll]
                    for l in 0..n {
                        d[l] = select(l == label_col % n, d[l] - target, d[l]);
                    }
                }
                if comptime![cfg.softcap] {
                    // d tanh(u)/du = 1/cosh²(u): exact where 1 − tanh² would
                    // cancel (|u| large, the capped regime).
                    let ch = (x / Vector::new(cap)).cosh();
                    d /= ch * ch;
                }
                let out = Vector::<F, N>::cast_from(d * Vector::new(g_scale));
                if comptime![cfg.in_place] {
                    logits[base + col] = out;
                } else {
                    grad[gbase + col] = out;
                }
            }
        }
    }
}

impl CrossEntropyLaunch {
    fn check<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        problem: &CrossEntropyProblem,
        in_place: bool,
    ) -> Result<CeConfig, KernelError> {
        let planes = launch::plane_sizes(client);
        let unsupported = |why: String| Err(KernelError::Unsupported(why));
        if self.vector_size == 0 || !problem.vocab.is_multiple_of(self.vector_size) {
            return unsupported(format!(
                "vector size {} does not divide the vocabulary {}",
                self.vector_size, problem.vocab
            ));
        }
        if !self.units.is_power_of_two() {
            return unsupported(format!("{self:?} is not a valid row layout"));
        }
        if self.reduce == RowReduce::Plane
            && (!planes.ops || !self.units.is_multiple_of(planes.max))
        {
            return unsupported(format!(
                "plane reduction over {} units needs plane ops and a multiple of the plane size {}",
                self.units, planes.max
            ));
        }
        let slots = row_sum_scratch(self.reduce, self.units, 1, planes.min);
        launch::check_cube_fits(client, self.units, slots * 4)?;
        Ok(CeConfig {
            units: self.units,
            slots: slots as u32,
            reduce: self.reduce,
            stats: problem.mode.stats(),
            grad: problem.mode.grad(),
            in_place,
            softcap: problem.softcap.is_some(),
            smoothing: problem.label_smoothing > 0.0,
            row_scale: problem.row_scale,
        })
    }
}

impl CrossEntropyProblem {
    /// The f32 values of the row scale.
    fn row_scale_len(&self) -> usize {
        match self.row_scale {
            RowScale::PerRow => self.rows,
            _ => 1,
        }
    }
}

impl CrossEntropyBuffers {
    /// Each buffer holds what the launch reads and writes (the losses in the
    /// stats modes, the gradient and row scale in the gradient modes), row
    /// strides a multiple of `v`.
    fn check(&self, p: &CrossEntropyProblem, v: usize) -> Result<(), KernelError> {
        let (rows, vocab, dtype) = (p.rows, p.vocab, p.dtype);
        self.logits
            .check("cross-entropy logits", rows, vocab, v, dtype)?;
        if let (Some(g), true) = (&self.grad, p.mode.grad()) {
            g.check("cross-entropy gradient", rows, vocab, v, dtype)?;
        }
        launch::check_holds("cross-entropy labels", &self.labels, rows, 4)?;
        if p.mode.stats() {
            launch::check_holds("cross-entropy losses", &self.losses, rows, 4)?;
        }
        launch::check_holds("cross-entropy lse", &self.lse, rows, 4)?;
        if let (Some(h), true) = (&self.row_scale, p.mode.grad()) {
            launch::check_holds("cross-entropy row scale", h, p.row_scale_len(), 4)?;
        }
        Ok(())
    }
}

fn validate(
    problem: &CrossEntropyProblem,
    buffers: &CrossEntropyBuffers,
) -> Result<(), KernelError> {
    problem.validate()?;
    if problem.row_scale != RowScale::None && buffers.row_scale.is_none() {
        return Err(KernelError::Shape(
            "a row scale mode needs a row_scale buffer".into(),
        ));
    }
    buffers.check(problem, 1)
}

/// Launches the kernel with one explicit configuration.
pub fn launch_with<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &CrossEntropyProblem,
    buffers: &CrossEntropyBuffers,
    config: &CrossEntropyLaunch,
) -> Result<(), KernelError> {
    validate(problem, buffers)?;
    let in_place = buffers.grad.is_none();
    let cfg = config.check(client, problem, in_place)?;
    if problem.rows == 0 {
        return Ok(());
    }
    let v = config.vector_size;
    let vocab_vecs = problem.vocab / v;
    let (row_vocab, first_col) = problem.columns();
    buffers.check(problem, v)?;
    let scale_len = problem.row_scale_len();
    // Arguments a mode does not use get a one-element stand-in.
    let dummy = || client.empty(16);
    let (grad, grad_stride) = match &buffers.grad {
        Some(g) => (g.arg(problem.rows, problem.vocab), g.stride_vecs(v)),
        None => (Rows::dense(dummy(), v).arg(1, v), 0),
    };
    let row_scale = match &buffers.row_scale {
        Some(h) => tensor_arg(h, scale_len, 1),
        None => tensor_arg(&dummy(), 1, 1),
    };
    let count = launch::cube_count(client, problem.rows)?;
    unsafe {
        cross_entropy_kernel::launch_unchecked::<R>(
            client,
            count,
            CubeDim::new_1d(config.units),
            v,
            buffers.logits.arg(problem.rows, problem.vocab),
            grad,
            tensor_arg(&buffers.labels, problem.rows, 1),
            tensor_arg(&buffers.losses, problem.rows, 1),
            tensor_arg(&buffers.lse, problem.rows, 1),
            row_scale,
            problem.rows,
            vocab_vecs,
            row_vocab,
            first_col,
            buffers.logits.stride_vecs(v),
            grad_stride,
            problem.ignore_index,
            problem.label_smoothing,
            problem.z_loss,
            problem.softcap.unwrap_or(1.0),
            problem.scale,
            cfg,
            problem.dtype.storage(),
        )
    }
    Ok(())
}

/// Largest cube the candidates use.
const MAX_UNITS: u32 = 1024;

/// Every configuration worth trying on this device, the default first.
pub fn candidates<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &CrossEntropyProblem,
) -> Vec<CrossEntropyLaunch> {
    let planes = launch::plane_sizes(client);
    let vector_size = problem.vector_size(client);
    let vocab_vecs = problem.vocab / vector_size;
    let widest = vocab_vecs
        .next_power_of_two()
        .clamp(planes.max as usize, MAX_UNITS as usize) as u32;
    let mut out = Vec::new();
    let mut units = planes.max.next_power_of_two().max(32);
    while units <= widest.max(32) {
        for reduce in [RowReduce::Plane, RowReduce::Shared] {
            let config = CrossEntropyLaunch {
                vector_size,
                units,
                reduce,
            };
            if config.check(client, problem, false).is_ok() {
                out.push(config);
            }
        }
        units *= 2;
    }
    // Default first: about 512 units on long rows (enough loads in flight
    // per SM, few iterations), fewer on short ones; plane reductions first.
    let ideal = widest.min(512);
    out.sort_by_key(|c| {
        (
            c.units.max(ideal) / c.units.min(ideal),
            c.reduce == RowReduce::Shared,
        )
    });
    out
}

/// The autotune key.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct CrossEntropyKey {
    pub rows_bucket: usize,
    pub vocab: usize,
    pub dtype: FloatDtype,
    pub vector_size: usize,
    pub mode: CrossEntropyMode,
    pub softcap: bool,
    pub smoothing: bool,
}

impl core::fmt::Display for CrossEntropyKey {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(
            f,
            "cross_entropy {:?} rows~{} vocab={} {} vec={} softcap={} smoothing={}",
            self.mode,
            self.rows_bucket,
            self.vocab,
            self.dtype,
            self.vector_size,
            self.softcap,
            self.smoothing
        )
    }
}

static TUNER: Tuner<CrossEntropyKey> = local_tuner!("bastile-cross-entropy");

/// Forgets every tuning decision taken in this process.
pub fn clear_autotune() {
    TUNER.clear();
}

static CANDIDATES: CandidateCache<(usize, FloatDtype, usize), CrossEntropyLaunch> =
    CandidateCache::new();

fn cached_candidates<R: Runtime>(
    client: &ComputeClient<R>,
    id: &cubecl::CubeTuneId,
    problem: &CrossEntropyProblem,
) -> Arc<Vec<CrossEntropyLaunch>> {
    let class = (
        problem.vocab,
        problem.dtype,
        gcd(problem.vocab, problem.stride_multiple),
    );
    CANDIDATES.get(id, class, || candidates(client, problem))
}

/// Whether some configuration fits rows of `vocab` logits of `dtype`.
pub fn supported<R: Runtime>(
    client: &ComputeClient<R>,
    device: &R::Device,
    problem: &CrossEntropyProblem,
) -> bool {
    client.properties().supports_type(problem.dtype.storage())
        && !cached_candidates(client, &cubecl::CubeTuneId::new(client, device), problem).is_empty()
}

/// The buffers benchmark runs use: a scratch gradient for an in-place
/// launch (tuning must never overwrite the logits the real launch reads)
/// and scratch statistics (a benchmark run must never write the real
/// outputs, whatever order the tuner runs it in).
fn bench_buffers<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &CrossEntropyProblem,
    buffers: &CrossEntropyBuffers,
) -> CrossEntropyBuffers {
    let mut bench = buffers.clone();
    let rows = problem.rows.max(1);
    if problem.mode.grad() && bench.grad.is_none() {
        let stride = buffers.logits.stride;
        bench.grad = Some(Rows {
            handle: client.empty((rows * stride * problem.dtype.size()).max(16)),
            stride,
        });
    }
    bench.losses = client.empty(rows * 4);
    if problem.mode.stats() {
        bench.lse = client.empty(rows * 4);
    }
    bench
}

/// Runs the kernel with the configuration autotuned for this problem class
/// on this device.
pub fn run<R: Runtime>(
    client: &ComputeClient<R>,
    device: &R::Device,
    problem: &CrossEntropyProblem,
    buffers: &CrossEntropyBuffers,
) -> Result<(), KernelError> {
    validate(problem, buffers)?;
    let id = cubecl::CubeTuneId::new(client, device);
    let candidates = cached_candidates(client, &id, problem);
    let key = CrossEntropyKey {
        rows_bucket: problem.rows.max(1).next_power_of_two(),
        vocab: problem.vocab,
        dtype: problem.dtype,
        vector_size: candidates.first().map_or(1, |c| c.vector_size),
        mode: problem.mode,
        softcap: problem.softcap.is_some(),
        smoothing: problem.label_smoothing > 0.0,
    };
    run_tuned_with(
        &TUNER,
        key,
        launch_with::<R>,
        bench_buffers::<R>,
        client,
        &id,
        problem,
        buffers,
        candidates,
    )
}
