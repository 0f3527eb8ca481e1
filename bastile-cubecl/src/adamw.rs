//! AdamW, fused: every element of a parameter, its gradient and both
//! moments is read once and written back updated, the arithmetic in f32
//! whatever the storage dtypes; and the global gradient norm that clipping
//! and the non-finite check need, reduced on the device in two stages (one
//! f32 partial per cube of every launch, then one cube over all partials),
//! so the host never waits for it.
//!
//! A launch takes several parameters at once (up to [`PARAMS_PER_LAUNCH`]
//! of the same dtypes and vector width for the update,
//! [`GRADS_PER_NORM_LAUNCH`] for the norm, fewer where the device binds
//! fewer buffers). Their vectors are laid end to end and cut into equal
//! spans, one a cube, that may cross from one parameter into the next: the
//! update's spans are small (four vectors a unit), the norm's as long as
//! one wave of a few cubes per streaming multiprocessor makes them. A
//! model's step is then a few dozen launches, not two per parameter, which
//! matters because most of a model's parameters (the norms' weights) are
//! too small to fill the device on their own; and no parameter leaves a
//! part-filled cube at its end. Every launch takes the same number of
//! slots, so one kernel of each is compiled.
//!
//! For the gradient `g` scaled by the clip factor `s`, step `t` (from 1),
//! learning rate `lr`, weight decay `λ`:
//!
//! ```text
//! m ← β1·m + (1 − β1)·s·g
//! v ← β2·v + (1 − β2)·(s·g)²
//! p ← p·(1 − lr·λ) − lr · (m / (1 − β1ᵗ)) / (√(v / (1 − β2ᵗ)) + ε)
//! ```
//!
//! as `torch.optim.AdamW` and Burn's `AdamW` compute it; the kernel orders
//! it as `torch.optim.AdamW` does, `p·(1 − lr·λ) − (lr / (1 − β1ᵗ)) · m /
//! (√v / √(1 − β2ᵗ) + ε)`, one division an element. With a master copy
//! `p` is the f32 master weight and the parameter receives its rounding
//! (mixed precision as HF Trainer's `bf16=True` runs it).
//!
//! The factors that change from step to step (the step size
//! `lr / (1 − β1ᵗ)`, the decay `1 − lr·λ` and `1 / √(1 − β2ᵗ)`, from
//! [`AdamWStep::factors`]) reach the kernel in a device buffer, not as
//! launch arguments: a step recorded as a CUDA graph then replays with the
//! next step's factors written into that buffer.
//!
//! The clip factor is `min(1, max_norm / (‖g‖ + 1e-6))` over every gradient
//! of the step, as `torch.nn.utils.clip_grad_norm_` computes it. When that
//! norm is not finite (a NaN or infinite gradient anywhere), the update
//! writes nothing: parameters, master weights and moments stay as they
//! were, and the caller reads the norm back to report the step.

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::elementwise::TileLaunch;
use crate::reduce::{CubeRowSum, cube_row_sum, lane_sum, row_sum};
use crate::{FloatDtype, KernelError, launch};

/// Units per cube of the norm reductions.
const NORM_UNITS: u32 = 256;
/// Cubes per streaming multiprocessor a norm launch uses at most: one
/// wave of equal spans (1 024 units an SM, each with four vector loads in
/// flight), few enough that the partials stay a small buffer. Qwen3-0.6B's
/// norm took 0.326 ms on an H200 so, against 0.369 ms with each gradient
/// cut into cubes of its own.
const NORM_CUBES_PER_SM: usize = 4;
/// Elements each unit of a norm cube sums at least: four rounds of four
/// vector loads in flight at eight elements a vector. With four elements a
/// unit, most of a cube's time went to its start and its reduction: the
/// norm read Qwen3-0.6B's 596 M bf16 gradients in 0.89 ms on an H200, a
/// third of the copy bandwidth.
const NORM_ELEMENTS_PER_UNIT: usize = 128;
/// Parameters one update launch takes at most (fewer where the device
/// binds fewer buffers): the kernel holds the update once per parameter,
/// which its compile time grows with (see `adamw_kernel`). Sixteen, half
/// the launches, took 2.29 ms for Qwen3-0.6B's update on an H200 against
/// 2.25 ms with eight (both with the update's earlier three divisions an
/// element).
pub const PARAMS_PER_LAUNCH: usize = 8;
/// Gradients one norm launch takes at most: its kernel holds one load per
/// gradient.
pub const GRADS_PER_NORM_LAUNCH: usize = 32;
/// The update's cubes: 256 units, four vectors each. Many small cubes
/// beat a grid of a few cubes an SM that loop over even shares: on an
/// H200, eight cubes an SM took 2.68 ms for Qwen3-0.6B's update against
/// 2.25 ms of four-vector cubes (both with the update's earlier three
/// divisions an element).
const UPDATE_TILE: TileLaunch = TileLaunch {
    vector_size: 0,
    units_per_cube: 256,
    items_per_unit: 4,
};
/// The guard `clip_grad_norm_` adds to the norm before dividing by it.
const NORM_GUARD: f32 = 1e-6;

/// The hyper-parameters of one optimizer step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    pub learning_rate: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub epsilon: f64,
    pub weight_decay: f64,
    /// The step number, from 1: the bias corrections depend on it.
    pub step: u64,
}

impl AdamWStep {
    /// Checks the values: a bad one would silently corrupt every parameter.
    pub fn validate(&self) -> Result<(), KernelError> {
        let bad = |why: String| Err(KernelError::Shape(why));
        let unit = |x: f64| x.is_finite() && (0.0..1.0).contains(&x);
        if !(self.learning_rate.is_finite() && self.learning_rate >= 0.0) {
            return bad(format!(
                "the learning rate must be finite and >= 0, got {}",
                self.learning_rate
            ));
        }
        if !unit(self.beta1) || !unit(self.beta2) {
            return bad(format!(
                "betas must lie in [0, 1), got ({}, {})",
                self.beta1, self.beta2
            ));
        }
        if !(self.epsilon.is_finite() && self.epsilon > 0.0) {
            return bad(format!("epsilon must be > 0, got {}", self.epsilon));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad(format!(
                "weight decay must be >= 0, got {}",
                self.weight_decay
            ));
        }
        if self.step == 0 {
            return bad("steps count from 1 (the bias corrections divide by 1 − βᵗ)".into());
        }
        Ok(())
    }

    /// `1 − βᵗ` for both moments, in f64 before the kernel's f32.
    pub fn bias_corrections(&self) -> (f64, f64) {
        let t = self.step.min(i32::MAX as u64) as i32;
        (1.0 - self.beta1.powi(t), 1.0 - self.beta2.powi(t))
    }

    /// The update's factors of this step, in the order [`update`] reads
    /// them from its `factors` buffer: the step size `lr / (1 − β1ᵗ)`, the
    /// decay `1 − lr·λ` and `1 / √(1 − β2ᵗ)`, computed in f64 (`1 − β` of
    /// an f32 β such as 0.999 is off by 1e-5) and rounded to f32 once.
    pub fn factors(&self) -> [f32; 3] {
        let (bias1, bias2) = self.bias_corrections();
        [
            (self.learning_rate / bias1) as f32,
            (1.0 - self.learning_rate * self.weight_decay) as f32,
            (1.0 / bias2.sqrt()) as f32,
        ]
    }
}

/// A device buffer holding `hyper`'s [`AdamWStep::factors`], for [`update`].
pub fn factors_buffer<R: Runtime>(client: &ComputeClient<R>, hyper: &AdamWStep) -> Handle {
    let bytes: Vec<u8> = hyper
        .factors()
        .iter()
        .flat_map(|f| f.to_le_bytes())
        .collect();
    client.create_from_slice(&bytes)
}

/// One parameter's update: `len` elements in contiguous buffers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWProblem {
    pub len: usize,
    pub param: FloatDtype,
    pub grad: FloatDtype,
    /// The dtype both moments are stored in.
    pub moments: FloatDtype,
    /// Whether an f32 master copy of the parameter is updated (and the
    /// parameter receives its rounding).
    pub master: bool,
}

/// The buffers of one parameter's update, each `len` contiguous elements
/// of its dtype; the parameter, the moments and the master copy are
/// updated in place.
#[derive(Clone, Debug)]
pub struct AdamWBuffers {
    pub param: Handle,
    pub grad: Handle,
    pub moment1: Handle,
    pub moment2: Handle,
    /// The f32 master copy, when the problem has one.
    pub master: Option<Handle>,
}

/// One parameter of a step's [`update`].
#[derive(Clone, Copy, Debug)]
pub struct ParamUpdate<'a> {
    pub problem: AdamWProblem,
    pub buffers: &'a AdamWBuffers,
}

fn check_len(
    what: &str,
    handle: &Handle,
    len: usize,
    dtype: FloatDtype,
) -> Result<(), KernelError> {
    launch::check_holds(what, handle, len, dtype.size())
}

impl AdamWProblem {
    /// Checks the buffers of parameter number `index` of a step.
    fn validate(&self, index: usize, buffers: &AdamWBuffers) -> Result<(), KernelError> {
        let of = |what: &str| format!("parameter {index}, {what}");
        check_len(&of("the weights"), &buffers.param, self.len, self.param)?;
        check_len(&of("the gradient"), &buffers.grad, self.len, self.grad)?;
        check_len(
            &of("the first moment"),
            &buffers.moment1,
            self.len,
            self.moments,
        )?;
        check_len(
            &of("the second moment"),
            &buffers.moment2,
            self.len,
            self.moments,
        )?;
        match (&buffers.master, self.master) {
            (Some(m), true) => check_len(&of("the master weights"), m, self.len, FloatDtype::F32),
            (None, false) => Ok(()),
            (None, true) => Err(KernelError::Shape(of(
                "the problem updates master weights but none were given",
            ))),
            (Some(_), false) => Err(KernelError::Shape(of(
                "master weights were given to a problem without them",
            ))),
        }
    }

    /// The widest vector every buffer of the update loads whole and
    /// aligned (a buffer may start inside a larger one).
    fn vector_size<R: Runtime>(&self, client: &ComputeClient<R>, buffers: &AdamWBuffers) -> usize {
        let mut views = vec![
            (self.param, &buffers.param),
            (self.grad, &buffers.grad),
            (self.moments, &buffers.moment1),
            (self.moments, &buffers.moment2),
        ];
        if let Some(master) = &buffers.master {
            views.push((FloatDtype::F32, master));
        }
        views
            .into_iter()
            .map(|(dtype, handle)| aligned_vector_size(client, dtype, self.len, handle))
            .min()
            .unwrap_or(1)
    }
}

/// The widest vector that divides `len` and the start of `handle`'s view.
fn aligned_vector_size<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: FloatDtype,
    len: usize,
    handle: &Handle,
) -> usize {
    let start = handle.offset_start.unwrap_or(0) as usize / dtype.size();
    launch::vector_size(client, dtype, launch::gcd(len, start))
}

/// Splits `items` into the launches that take them: items of one key (the
/// dtypes and vector width a kernel is compiled for) in the order they
/// come, at most `per_launch` a launch.
fn launches<K: PartialEq + Copy>(
    items: impl Iterator<Item = (K, usize)>,
    per_launch: usize,
) -> Vec<(K, Vec<usize>)> {
    let mut groups: Vec<(K, Vec<usize>)> = Vec::new();
    for (key, index) in items {
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, members)) => members.push(index),
            None => groups.push((key, vec![index])),
        }
    }
    groups
        .into_iter()
        .flat_map(|(key, members)| {
            members
                .chunks(per_launch.max(1))
                .map(|chunk| (key, chunk.to_vec()))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// How many items of `buffers_each` buffers one launch may take next to
/// `shared` buffers of its own: at most `most`, within the device's
/// binding limit.
fn per_launch<R: Runtime>(
    client: &ComputeClient<R>,
    buffers_each: usize,
    shared: usize,
    most: usize,
) -> usize {
    let bindings = client.properties().hardware.max_bindings as usize;
    // One binding more stays free for the launch's metadata.
    let room = bindings.saturating_sub(shared + 1) / buffers_each;
    room.clamp(1, most)
}

/// `values` extended to `len` with copies of its last. Every launch of a
/// kernel then takes the same number of slots, so one compiled kernel
/// serves them all (a kernel is compiled for its slot count); the first
/// cubes padded so, the extra slots own no cube and are never read.
fn pad_to<T: Clone>(mut values: Vec<T>, len: usize) -> Vec<T> {
    if let Some(last) = values.last().cloned() {
        values.resize(len.max(values.len()), last);
    }
    values
}

/// The first vector of each item of a launch, its items laid end to end,
/// and last the vectors of all of them: `counts.len() + 1` values.
fn starts(counts: &[usize]) -> Vec<usize> {
    let mut starts = vec![0];
    for c in counts {
        starts.push(starts.last().unwrap() + c);
    }
    starts
}

/// An even split of `total` vectors: `(cubes, vectors per cube)`, every
/// cube at least `least` vectors (the last one fewer) and at most
/// `most_cubes` cubes; `cubes` is the number that own vectors.
fn even_split(total: usize, least: usize, most_cubes: usize) -> (usize, usize) {
    let wanted = total.div_ceil(least.max(1)).clamp(1, most_cubes.max(1));
    let per_cube = total.div_ceil(wanted).max(1);
    (total.div_ceil(per_cube).max(1), per_cube)
}

fn scalars<R: Runtime>(values: &[usize]) -> SequenceArg<R, usize> {
    values.iter().copied().collect()
}

fn tensors<R: Runtime, T: CubePrimitive>(
    views: impl IntoIterator<Item = (Handle, usize)>,
) -> SequenceArg<R, Tensor<T>> {
    views
        .into_iter()
        .map(|(handle, len)| unsafe {
            TensorArg::<R>::from_raw_parts(handle, [1].into(), [len].into())
        })
        .collect()
}

/// What one update launch is compiled for: the parameters it takes share it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct UpdateKey {
    param: FloatDtype,
    grad: FloatDtype,
    moments: FloatDtype,
    master: bool,
    vector_size: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct UpdateConfig {
    units_per_cube: u32,
    /// Vectors a unit updates at most: a cube's span is at most this many
    /// vectors a unit.
    vectors_per_unit: u32,
    master: bool,
    clipped: bool,
}

/// The span of the launch's vectors, laid end to end, that cube `cube`
/// owns: `[begin, end)`, empty for a cube past the last.
#[cube]
fn cube_span(per_cube: usize, total: usize, cube: usize) -> (usize, usize) {
    let begin = cube * per_cube;
    let end = select(begin + per_cube < total, begin + per_cube, total);
    (begin, end)
}

/// The part of item `t`'s vectors (`starts[t] <= j < starts[t + 1]` in the
/// launch's order) inside `[begin, end)`, as indices into the item: `(from,
/// to)`, `from >= to` when they do not meet. `t` is known at compile time:
/// a sequence is indexed by compile-time positions only.
#[cube]
fn item_part(
    starts: &Sequence<usize>,
    #[comptime] t: usize,
    begin: usize,
    end: usize,
) -> (usize, usize) {
    let first = starts[t];
    let last = starts[t + 1];
    let lo = select(begin > first, begin, first);
    let hi = select(end < last, end, last);
    (lo - first, select(hi > lo, hi, lo) - first)
}

/// Updates the parameters of the launch: their vectors laid end to end
/// (parameter `t` holds `starts[t] <= j < starts[t + 1]`), cube `c` the
/// `per_cube` from `c · per_cube`.
///
/// The tensors of a launch are separate bindings, so the update is written
/// once per parameter, and a launch takes few of them
/// ([`PARAMS_PER_LAUNCH`]) with its vector loop rolled. On an H100, with the
/// norm's kernel: 32 parameters with the loop unrolled took 38 s to
/// compile and 8.95 ms for Qwen3-0.6B's optimizer step, 8 rolled 1.8 s and
/// 6.75 ms. Writing the arithmetic once and each parameter's loads and
/// stores per parameter compiled as fast but took 14.3 ms a step.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn adamw_kernel<P: Float, G: Float, M: Float, N: Size>(
    params: &mut Sequence<Tensor<Vector<P, N>>>,
    grads: &Sequence<Tensor<Vector<G, N>>>,
    moment1: &mut Sequence<Tensor<Vector<M, N>>>,
    moment2: &mut Sequence<Tensor<Vector<M, N>>>,
    master: &mut Sequence<Tensor<Vector<f32, N>>>,
    clip: &Tensor<f32>,
    // `[lr / (1 − β1ᵗ), 1 − lr·λ, 1 / √(1 − β2ᵗ)]`, see `AdamWStep::factors`.
    factors: &Tensor<f32>,
    starts: Sequence<usize>,
    per_cube: usize,
    // `1 − β` computed in f64, as the factors are.
    beta1: f32,
    beta2: f32,
    gain1: f32,
    gain2: f32,
    epsilon: f32,
    #[comptime] cfg: UpdateConfig,
    #[define(P, G, M)] _dtypes: [StorageType; 3],
) {
    let mut scale = 1.0f32;
    let mut skip = false;
    if comptime![cfg.clipped] {
        scale = clip[0];
        let norm = clip[1];
        skip = norm.is_nan() || norm.is_inf();
    }
    let count = comptime![params.len()];
    let units = comptime![cfg.units_per_cube as usize];
    let per_unit = comptime![cfg.vectors_per_unit as usize];
    let (begin, end) = cube_span(per_cube, starts[count], CUBE_POS);
    if !skip {
        let step_size = factors[0];
        let decay = factors[1];
        let inv_sqrt_bias2 = factors[2];
        let b1 = Vector::<f32, N>::new(beta1);
        let b2 = Vector::<f32, N>::new(beta2);
        let k1 = Vector::<f32, N>::new(gain1);
        let k2 = Vector::<f32, N>::new(gain2);
        #[unroll]
        for t in 0..count {
            let (from, to) = item_part(&starts, t, begin, end);
            if from < to {
                let param = params.index_mut(t);
                let moment1 = moment1.index_mut(t);
                let moment2 = moment2.index_mut(t);
                let grad = grads.index(t);
                // A cube's span is at most `per_unit` vectors a unit, so
                // this loop's bound is known at compile time.
                for k in 0..per_unit {
                    let i = from + k * units + UNIT_POS as usize;
                    if i < to {
                        let p = if comptime![cfg.master] {
                            master.index(t)[i]
                        } else {
                            Vector::<f32, N>::cast_from(param[i])
                        };
                        let g = Vector::<f32, N>::cast_from(grad[i]) * Vector::new(scale);
                        let m = b1 * Vector::cast_from(moment1[i]) + k1 * g;
                        let v = b2 * Vector::cast_from(moment2[i]) + k2 * g * g;
                        // In `torch.optim.AdamW`'s order, the bias
                        // corrections folded into the step size and the
                        // denominator's scale (a product with the reciprocal
                        // here): one division an element instead of three.
                        let denom = v.sqrt() * Vector::new(inv_sqrt_bias2) + Vector::new(epsilon);
                        let p = p * Vector::new(decay) - Vector::new(step_size) * m / denom;
                        moment1[i] = Vector::cast_from(m);
                        moment2[i] = Vector::cast_from(v);
                        if comptime![cfg.master] {
                            let master = master.index_mut(t);
                            master[i] = p;
                        }
                        param[i] = Vector::cast_from(p);
                    }
                }
            }
        }
    }
}

/// Updates every parameter of `params`, their moments (and master copies)
/// in place, the gradients scaled by `clip[0]` and the whole step skipped
/// when the norm `clip[1]` is not finite (`clip` from [`clip_scale`];
/// `None` takes the gradients as they are). `factors` holds the step's
/// [`AdamWStep::factors`] ([`factors_buffer`]); `hyper` gives the betas
/// and ε.
pub fn update<R: Runtime>(
    client: &ComputeClient<R>,
    hyper: &AdamWStep,
    clip: Option<&Handle>,
    factors: &Handle,
    params: &[ParamUpdate],
) -> Result<(), KernelError> {
    hyper.validate()?;
    for (i, p) in params.iter().enumerate() {
        p.problem.validate(i, p.buffers)?;
    }
    if let Some(clip) = clip {
        check_len("the clip factor", clip, 2, FloatDtype::F32)?;
    }
    check_len("the step's factors", factors, 3, FloatDtype::F32)?;
    let keyed = params.iter().enumerate().filter_map(|(i, p)| {
        let key = UpdateKey {
            param: p.problem.param,
            grad: p.problem.grad,
            moments: p.problem.moments,
            master: p.problem.master,
            vector_size: p.problem.vector_size(client, p.buffers),
        };
        (p.problem.len > 0).then_some((key, i))
    });
    let with_master = params.iter().any(|p| p.problem.master);
    let per = per_launch(client, 4 + with_master as usize, 1, PARAMS_PER_LAUNCH);
    let dummy = client.empty(16);
    // Every launch is checked before the first one runs, so a refusal
    // leaves every parameter as it was.
    let mut checked = Vec::new();
    for (key, members) in launches(keyed, per) {
        let v = key.vector_size;
        let tile = TileLaunch {
            vector_size: v,
            ..UPDATE_TILE
        };
        tile.check(client)?;
        let vector_counts: Vec<usize> =
            members.iter().map(|&i| params[i].problem.len / v).collect();
        let starts = starts(&vector_counts);
        let (cubes, per_cube) = even_split(
            *starts.last().unwrap(),
            (tile.units_per_cube * tile.items_per_unit) as usize,
            usize::MAX,
        );
        let cubes = launch::cube_count(client, cubes)?;
        checked.push((key, members, tile, starts, per_cube, cubes));
    }
    for (key, members, tile, starts, per_cube, cubes) in checked {
        let v = key.vector_size;
        let cfg = UpdateConfig {
            units_per_cube: tile.units_per_cube,
            vectors_per_unit: tile.items_per_unit,
            master: key.master,
            clipped: clip.is_some(),
        };
        let view = |pick: &dyn Fn(&AdamWBuffers) -> Handle| {
            let views = members
                .iter()
                .map(move |&i| (pick(params[i].buffers), params[i].problem.len))
                .collect::<Vec<_>>();
            pad_to(views, per)
        };
        let masters = if key.master {
            view(&|b| b.master.clone().expect("validated"))
        } else {
            Vec::new()
        };
        unsafe {
            adamw_kernel::launch_unchecked::<R>(
                client,
                cubes,
                tile.cube_dim(),
                v,
                tensors(view(&|b| b.param.clone())),
                tensors(view(&|b| b.grad.clone())),
                tensors(view(&|b| b.moment1.clone())),
                tensors(view(&|b| b.moment2.clone())),
                tensors(masters),
                TensorArg::from_raw_parts(clip.unwrap_or(&dummy).clone(), [1].into(), [2].into()),
                TensorArg::from_raw_parts(factors.clone(), [1].into(), [3].into()),
                scalars(&pad_to(starts, per + 1)),
                per_cube,
                hyper.beta1 as f32,
                hyper.beta2 as f32,
                (1.0 - hyper.beta1) as f32,
                (1.0 - hyper.beta2) as f32,
                hyper.epsilon as f32,
                cfg,
                [
                    key.param.storage(),
                    key.grad.storage(),
                    key.moments.storage(),
                ],
            )
        }
    }
    Ok(())
}

/// The cubes a norm launch gives `len` elements: enough that each unit
/// sums at least [`NORM_ELEMENTS_PER_UNIT`], at most
/// [`NORM_CUBES_PER_SM`] a streaming multiprocessor. Each cube writes one
/// partial sum; a launch over several gradients has at most the sum of
/// their counts, which [`partials_len`] adds up.
fn norm_cubes<R: Runtime>(client: &ComputeClient<R>, len: usize) -> usize {
    let most = NORM_CUBES_PER_SM * launch::parallel_units(client);
    len.div_ceil(NORM_ELEMENTS_PER_UNIT * NORM_UNITS as usize)
        .clamp(1, most)
}

/// Sums the squares of the gradients of the launch, their vectors laid end
/// to end (gradient `t` holds `starts[t] <= j < starts[t + 1]`): cube `c`
/// sums the `per_cube` from `c · per_cube` into `partials[offset + c]`. A
/// sequence's tensors are picked at compile time, so the summing loop is
/// written once per gradient, inside the branch of each gradient the
/// cube's span meets.
#[cube(launch_unchecked)]
fn sum_squares_kernel<G: Float, N: Size>(
    grads: &Sequence<Tensor<Vector<G, N>>>,
    partials: &mut Tensor<f32>,
    starts: Sequence<usize>,
    per_cube: usize,
    offset: usize,
    #[comptime] cfg: CubeRowSum,
    #[define(G)] _dtype: StorageType,
) {
    let units = comptime![NORM_UNITS as usize];
    let count = comptime![grads.len()];
    let total = starts[count];
    let (begin, end) = cube_span(per_cube, total, CUBE_POS);
    let mut acc = Vector::<f32, N>::new(0.0);
    // The loop sits inside the gradient's branch, with four loads a round
    // in flight per unit: a branch per load (the gradient picked for each
    // vector) kept one load in flight and held the sum to a quarter of the
    // memory bandwidth.
    #[unroll]
    for t in 0..count {
        let (from, to) = item_part(&starts, t, begin, end);
        if from < to {
            let grad = grads.index(t);
            let rounds = (to - from) / (4 * units);
            for r in 0..rounds {
                let i = from + r * 4 * units + UNIT_POS as usize;
                let a = Vector::<f32, N>::cast_from(grad[i]);
                let b = Vector::<f32, N>::cast_from(grad[i + units]);
                let c = Vector::<f32, N>::cast_from(grad[i + 2 * units]);
                let d = Vector::<f32, N>::cast_from(grad[i + 3 * units]);
                acc += a * a + b * b + c * c + d * d;
            }
            let rest = from + rounds * 4 * units;
            for k in 0..(to - rest).div_ceil(units) {
                let i = rest + k * units + UNIT_POS as usize;
                if i < to {
                    let g = Vector::<f32, N>::cast_from(grad[i]);
                    acc += g * g;
                }
            }
        }
    }
    let mut scratch = SharedMemory::<f32>::new(cfg.slots as usize);
    let sum = row_sum(
        lane_sum(acc),
        &mut scratch,
        NORM_UNITS,
        cfg.slots,
        cfg.reduce,
    );
    if UNIT_POS == 0 && begin < total {
        partials[offset + CUBE_POS] = sum;
    }
}

#[cube(launch_unchecked)]
fn clip_scale_kernel(
    partials: &Tensor<f32>,
    out: &mut Tensor<f32>,
    count: usize,
    max_norm: f32,
    #[comptime] clip: bool,
    #[comptime] cfg: CubeRowSum,
) {
    let units = comptime![NORM_UNITS as usize];
    let mut acc = 0.0f32;
    for k in 0..count.div_ceil(units) {
        let i = k * units + UNIT_POS as usize;
        if i < count {
            acc += partials[i];
        }
    }
    let mut scratch = SharedMemory::<f32>::new(cfg.slots as usize);
    let total = row_sum(acc, &mut scratch, NORM_UNITS, cfg.slots, cfg.reduce);
    if UNIT_POS == 0 {
        let norm = total.sqrt();
        let mut scale = 1.0f32;
        if comptime![clip] {
            let guard = comptime![NORM_GUARD].runtime();
            scale = f32::min(1.0, max_norm / (norm + guard));
        }
        out[0] = scale;
        out[1] = norm;
    }
}

/// Reduces the first `count` partials into `out = [scale, norm]` (f32): the
/// global L2 norm of the gradients and the factor that clips it to
/// `max_norm` (1 without clipping).
pub fn clip_scale<R: Runtime>(
    client: &ComputeClient<R>,
    partials: &Handle,
    count: usize,
    max_norm: Option<f64>,
    out: &Handle,
) -> Result<(), KernelError> {
    if let Some(max) = max_norm
        && !(max.is_finite() && max > 0.0)
    {
        return Err(KernelError::Shape(format!(
            "the clipping bound must be positive, got {max}"
        )));
    }
    check_len("the norm partials", partials, count, FloatDtype::F32)?;
    check_len("the clip factor", out, 2, FloatDtype::F32)?;
    let cfg = cube_row_sum(client, NORM_UNITS)?;
    unsafe {
        clip_scale_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(NORM_UNITS),
            launch::flat_arg(partials, count),
            TensorArg::from_raw_parts(out.clone(), [1].into(), [2].into()),
            count,
            max_norm.unwrap_or(1.0) as f32,
            max_norm.is_some(),
            cfg,
        )
    }
    Ok(())
}

/// One gradient of a step: `len` contiguous elements of `dtype`.
#[derive(Clone, Copy, Debug)]
pub struct GradView<'a> {
    pub handle: &'a Handle,
    pub len: usize,
    pub dtype: FloatDtype,
}

/// The f32 partials [`global_norm`] needs for gradients of these lengths
/// (at most: gradients that share a launch may write fewer).
pub fn partials_len<R: Runtime>(
    client: &ComputeClient<R>,
    lens: impl Iterator<Item = usize>,
) -> usize {
    lens.map(|len| norm_cubes(client, len)).sum()
}

/// Writes `out = [scale, norm]` (f32) over every gradient of the step:
/// several gradients a launch, each launch's vectors split evenly over one
/// wave of at most a few cubes per streaming multiprocessor, one f32
/// partial sum per cube into
/// `partials` (at least [`partials_len`] f32), then one cube over all of
/// them (see [`clip_scale`]).
pub fn global_norm<R: Runtime>(
    client: &ComputeClient<R>,
    grads: &[GradView],
    partials: &Handle,
    max_norm: Option<f64>,
    out: &Handle,
) -> Result<(), KernelError> {
    for (i, g) in grads.iter().enumerate() {
        check_len(&format!("gradient {i}"), g.handle, g.len, g.dtype)?;
    }
    let total = partials_len(client, grads.iter().map(|g| g.len));
    check_len("the norm partials", partials, total, FloatDtype::F32)?;
    let cfg = cube_row_sum(client, NORM_UNITS)?;
    let keyed = grads.iter().enumerate().filter_map(|(i, g)| {
        let v = aligned_vector_size(client, g.dtype, g.len, g.handle);
        (g.len > 0).then_some(((g.dtype, v), i))
    });
    let mut offset = 0;
    let per = per_launch(client, 1, 1, GRADS_PER_NORM_LAUNCH);
    for ((dtype, v), members) in launches(keyed, per) {
        let vector_counts: Vec<usize> = members.iter().map(|&i| grads[i].len / v).collect();
        let starts = starts(&vector_counts);
        let elements: usize = members.iter().map(|&i| grads[i].len).sum();
        // As many cubes as `norm_cubes` gives the launch's elements, so
        // never more than `partials_len` counted for its gradients.
        let (cubes, per_cube) =
            even_split(*starts.last().unwrap(), 1, norm_cubes(client, elements));
        unsafe {
            sum_squares_kernel::launch_unchecked::<R>(
                client,
                launch::cube_count(client, cubes)?,
                CubeDim::new_1d(NORM_UNITS),
                v,
                tensors(pad_to(
                    members
                        .iter()
                        .map(|&i| (grads[i].handle.clone(), grads[i].len))
                        .collect(),
                    per,
                )),
                TensorArg::from_raw_parts(partials.clone(), [1].into(), [total].into()),
                scalars(&pad_to(starts, per + 1)),
                per_cube,
                offset,
                cfg,
                dtype.storage(),
            )
        }
        offset += cubes;
    }
    clip_scale(client, partials, offset, max_norm, out)
}
