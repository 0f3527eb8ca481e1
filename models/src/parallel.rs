//! Data-parallel training: one worker per device, each with a replica of
//! the model and its own optimizer, the gradients summed across workers
//! before every update so that the replicas stay identical.
//!
//! A [`Trainer`] made data-parallel with [`Trainer::data_parallel`] is
//! worker 0, on the caller's thread and device; every other device gets a
//! worker thread holding its replica. [`Trainer::step`] then takes the
//! micro-batches of all workers, gives each worker an equal, consecutive
//! share, and returns when every worker's step is done:
//!
//! * the counted tokens of all workers are summed before any loss is
//!   divided by them, and every micro-batch's gradients are summed, so the
//!   step equals one worker's step over all the micro-batches (gradient
//!   accumulation), up to the summation order;
//! * with [`Collective::host`] and `Collective::during_backward` the
//!   gradients are summed while the backward pass runs: it runs segment
//!   by segment (the head and loss, each decoder layer last first, the
//!   embeddings; layers are recomputed only as the model's checkpointing
//!   says), and each segment's gradients are handed to the sums as soon
//!   as its backward pass is queued, so on CUDA NCCL sums layer `l` while
//!   the GPU computes the gradients of layer `l - 1`; the embedding
//!   lookup's part of the embeddings' gradient is not summed whole but
//!   gathered (every worker's ids and output gradients: `workers × tokens
//!   × (hidden + 1)` values instead of `vocab × hidden`) and added on
//!   every worker, so a tied head's part is summed with the head, early;
//!   otherwise each worker queues the sums after its backward pass;
//! * a check that fails on one worker (an id or label out of range) skips
//!   the step on all of them (the skip flags are summed too), and the step's
//!   error names that worker;
//! * a worker that fails or stops answering (out of memory, a panic, a
//!   collective that never completes) ends the run: the step returns
//!   [`ModelError::Worker`] within [`DataParallelOptions::wait`], and so
//!   does every later step, since the replicas may no longer agree.
//!
//! The sums run through a [`Collective`]: on CUDA, NCCL through Burn's
//! collective operations (`Collective::nccl`, feature `distributed`),
//! queued on the device; on any backend, a rendezvous of the workers on
//! the host ([`Collective::host`]), which reads every gradient back and
//! suits tests and small models.

use std::marker::PhantomData;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Bool, Int, Tensor, TensorData};

use crate::checkpointing::{SegmentSink, add_lookup_grad};
use crate::{CausalLm, MicroBatch, ModelError, StepOutput, Trainer};

/// How the workers' tensors are summed.
#[derive(Clone)]
pub struct Collective<B: Backend> {
    reduce: Reduce<B>,
    workers: usize,
    /// The gradients' sums, started segment by segment while the
    /// backward passes run.
    segments: Arc<SegmentSums<Part<B>>>,
    /// Whether the gradients are summed during the backward pass (else
    /// after it).
    during_backward: bool,
}

/// One gradient (flattened) in a segment's sums.
enum Part<B: Backend> {
    /// Read back, for a host sum.
    Host(TensorData),
    /// On its worker's device, for NCCL, with the stream of the worker
    /// that queued it: its sum is queued on that stream, whichever worker
    /// starts it.
    #[cfg_attr(not(feature = "distributed"), allow(dead_code))]
    Device(Tensor<B, 1>, burn::tensor::StreamId),
}

#[derive(Clone)]
enum Reduce<B: Backend> {
    Host(Arc<HostSum>, PhantomData<fn() -> B>),
    #[cfg(feature = "distributed")]
    Device {
        ids: Vec<DeviceId>,
        all_reduce: fn(FloatPrimitive<B>, Vec<DeviceId>) -> FloatPrimitive<B>,
        settle: fn(&B::Device),
    },
}

#[cfg(feature = "distributed")]
use burn::tensor::backend::DeviceId;

/// A float tensor of `B`, as Burn's backend operations take it.
#[cfg(feature = "distributed")]
type FloatPrimitive<B> = <B as burn::tensor::backend::BackendTypes>::FloatTensorPrimitive;

impl<B: Backend> Collective<B> {
    /// Sums on the host: each worker reads its tensor back, the last to
    /// arrive adds them (in f32, worker order) and every worker uploads the
    /// sum. Works on every backend; a worker that waits longer than `wait`
    /// for the others gives up (its step then reports the missing worker).
    pub fn host(workers: usize, wait: Duration) -> Self {
        Self {
            reduce: Reduce::Host(Arc::new(HostSum::new(workers, wait)), PhantomData),
            workers,
            segments: Arc::new(SegmentSums::new(workers)),
            during_backward: true,
        }
    }

    /// NCCL's all-reduce over `devices` (one worker each, in this order),
    /// through Burn's collective operations: queued on each device's
    /// communication stream, which its compute stream then waits for (the
    /// host waits for the sums only where it reads them). NCCL is loaded
    /// at run time (`libnccl.so` on the library path).
    ///
    /// Each worker queues the sums of its gradients after its backward
    /// pass, which works on every backend; on a backend that launches
    /// each operation when it is called, [`Collective::during_backward`]
    /// sums them while the backward pass runs.
    #[cfg(feature = "distributed")]
    pub fn nccl(devices: &[B::Device]) -> Result<Self, ModelError>
    where
        B: burn::tensor::backend::distributed::DistributedBackend,
    {
        use burn::tensor::backend::DeviceOps;
        use burn::tensor::backend::distributed::ReduceOperation;
        let ids: Vec<_> = devices.iter().map(|d| d.id()).collect();
        for (i, id) in ids.iter().enumerate() {
            if ids[..i].contains(id) {
                return Err(ModelError::Config(format!(
                    "NCCL needs one worker per device; device {:?} is listed twice",
                    devices[i]
                )));
            }
        }
        fn all_reduce<B: burn::tensor::backend::distributed::DistributedBackend>(
            t: FloatPrimitive<B>,
            ids: Vec<DeviceId>,
        ) -> FloatPrimitive<B> {
            // SAFETY: the sum is read only after `settle`, which makes the
            // device's compute stream wait for the communication stream.
            unsafe { B::all_reduce(t, ReduceOperation::Sum, ids).assume_resolved() }
        }
        Ok(Self {
            reduce: Reduce::Device {
                ids,
                all_reduce: all_reduce::<B>,
                settle: B::sync_collective,
            },
            workers: devices.len(),
            segments: Arc::new(SegmentSums::new(devices.len())),
            during_backward: false,
        })
    }

    /// Sums the gradients while the backward pass runs: the backward pass
    /// runs segment by segment (see the [module](self) documentation), and
    /// the worker that hands over a segment's gradients last queues the
    /// segment's all-reduces on every worker's device, so that NCCL sums
    /// layer `l` while the GPUs compute the gradients of layer `l - 1`.
    ///
    /// For backends that launch each operation when it is called, such as
    /// `CubeBackend` (`bastile::CudaDirect`). Under Burn's fusion stream
    /// (`burn::backend::Cuda`), which queues operations and runs them
    /// later, all-reduces queued from one worker's thread onto another's
    /// device can wait on each other: there the sums stay after the
    /// backward pass.
    #[cfg(feature = "distributed")]
    pub fn during_backward(mut self) -> Self {
        self.during_backward = true;
        self
    }

    /// Workers taking part.
    pub fn workers(&self) -> usize {
        self.workers
    }

    /// The sum of `t` over the workers; every worker calls this for the
    /// same tensors in the same order, then [`Self::settle`] before the
    /// sums are used.
    fn sum<const D: usize>(&self, rank: usize, t: Tensor<B, D>) -> Tensor<B, D> {
        match &self.reduce {
            Reduce::Host(host, _) => {
                let device = t.device();
                let dtype = t.dtype();
                let summed = host.sum(rank, t.into_data());
                Tensor::from_data(summed.convert_dtype(dtype), &device)
            }
            #[cfg(feature = "distributed")]
            Reduce::Device {
                ids, all_reduce, ..
            } => {
                let t = t.into_primitive().tensor();
                Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(all_reduce(
                    t,
                    ids.clone(),
                )))
            }
        }
    }

    /// A worker's part of a segment's sums, made on the worker's own
    /// thread: on the host the tensor's values (no worker touches
    /// another's tensors); on the device the tensor itself, with
    /// `hand_over`, the worker's stream for its sums.
    ///
    /// Whichever worker starts the sum, it waits on the device for what
    /// the worker had queued when it handed the tensor over, no more: a
    /// one-element read of the tensor on `hand_over` orders that stream
    /// after the kernels queued so far, and the sum is queued there later
    /// (on the worker's compute stream it would also wait for every
    /// kernel the worker queued in between).
    #[cfg_attr(not(feature = "distributed"), allow(unused_variables))]
    fn part(&self, t: Tensor<B, 1>, hand_over: burn::tensor::StreamId) -> Part<B> {
        match &self.reduce {
            Reduce::Host(..) => Part::Host(t.into_data()),
            #[cfg(feature = "distributed")]
            Reduce::Device { .. } => {
                hand_over.executes(|| drop(t.clone().slice(0..1).add_scalar(0.0)));
                Part::Device(t, hand_over)
            }
        }
    }

    /// Starts the sums of one segment: `parts[rank]` are worker `rank`'s
    /// parts, in one order on every worker. On the device each tensor is
    /// all-reduced in place on its worker's device (the calls are queued
    /// worker by worker, in that one order on every device, as NCCL
    /// needs); on the host the values are added.
    fn sum_segment(&self, parts: Vec<Vec<Part<B>>>) -> Vec<Vec<Part<B>>> {
        match &self.reduce {
            Reduce::Host(..) => combine_on_host(parts, |column| {
                add_parts(&column).convert_dtype(column[0].dtype)
            }),
            #[cfg(feature = "distributed")]
            Reduce::Device {
                ids, all_reduce, ..
            } => parts
                .into_iter()
                .map(|part| {
                    let mut sent_from = None;
                    let sums = part
                        .into_iter()
                        .map(|p| match p {
                            Part::Device(t, stream) => {
                                sent_from.get_or_insert_with(|| (t.device(), stream));
                                let t = stream.executes(|| {
                                    all_reduce(t.into_primitive().tensor(), ids.clone())
                                });
                                Part::Device(
                                    Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(t)),
                                    stream,
                                )
                            }
                            Part::Host(_) => unreachable!("a device sum holds tensors"),
                        })
                        .collect();
                    if let Some((device, stream)) = sent_from {
                        self.send(&device, stream);
                    }
                    sums
                })
                .collect(),
        }
    }

    /// Starts the gathers of one segment: `parts[rank]` are worker
    /// `rank`'s parts, in one order on every worker, each of any length.
    /// Every worker gets, for each part, every worker's values in worker
    /// order: on the host one after another; on the device in a slot per
    /// worker as long as the longest worker's part, the rest of each slot
    /// zeros (each worker writes its slot and the slots are all-reduced,
    /// which adds only zeros to every value).
    fn gather_segment(&self, parts: Vec<Vec<Part<B>>>) -> Vec<Vec<Part<B>>> {
        match &self.reduce {
            Reduce::Host(..) => combine_on_host(parts, |column| {
                let dtype = column[0].dtype;
                let mut values = Vec::new();
                for data in column {
                    let data = data.convert::<f32>();
                    values.extend_from_slice(data.as_slice::<f32>().expect("f32 values"));
                }
                let len = values.len();
                TensorData::new(values, [len]).convert_dtype(dtype)
            }),
            #[cfg(feature = "distributed")]
            Reduce::Device { .. } => {
                let workers = parts.len();
                let len = |p: &Part<B>| match p {
                    Part::Device(t, _) => t.dims()[0],
                    Part::Host(_) => unreachable!("a device gather holds tensors"),
                };
                let slots: Vec<usize> = (0..parts[0].len())
                    .map(|i| parts.iter().map(|p| len(&p[i])).max().unwrap_or(0))
                    .collect();
                let placed = parts
                    .into_iter()
                    .enumerate()
                    .map(|(rank, part)| {
                        part.into_iter()
                            .zip(&slots)
                            .map(|(p, &slot)| {
                                let Part::Device(t, stream) = p else {
                                    unreachable!("a device gather holds tensors")
                                };
                                let placed = stream.executes(|| {
                                    let n = t.dims()[0];
                                    let all = Tensor::<B, 1>::zeros(
                                        [workers * slot],
                                        (&t.device(), t.dtype()),
                                    );
                                    if n == 0 {
                                        all
                                    } else {
                                        all.slice_assign(rank * slot..rank * slot + n, t)
                                    }
                                });
                                Part::Device(placed, stream)
                            })
                            .collect()
                    })
                    .collect();
                self.sum_segment(placed)
            }
        }
    }

    /// Why the sums can no longer be trusted: a sum gave up on a worker
    /// after `wait` (its sums since then are this worker's values alone),
    /// or a worker failed before it handed over its gradients.
    fn broken(&self, wait: Duration) -> Option<String> {
        if let Some(why) = self.segments.broken() {
            return Some(why);
        }
        match &self.reduce {
            Reduce::Host(host, _) if host.state.lock().map_or(true, |s| s.broken) => Some(format!(
                "a sum over the workers waited longer than {:.0} s for another worker",
                wait.as_secs_f64()
            )),
            _ => None,
        }
    }

    /// Hands the sums queued on `device` to the device's thread at once;
    /// only `stream` (a hand-over stream) waits for them, not the
    /// worker's later work.
    ///
    /// CubeCL collects a device's operations in batches and starts one
    /// when it fills or someone waits. An all-reduce left in a batch that
    /// has not started can deadlock the step: NCCL's kernel on another GPU
    /// waits for this one's, and that GPU's device thread may wait for
    /// its GPU (loading a module waits for the running kernels, NCCL's
    /// first call on a communicator waits for its peers' calls), while
    /// the worker that would fill this batch waits for that device or for
    /// another worker's autodiff graph. Settling on `stream` sends the
    /// batch.
    fn send(&self, device: &B::Device, stream: burn::tensor::StreamId) {
        stream.executes(|| self.settle(device));
    }

    /// Makes `device`'s later work wait for the sums queued so far.
    #[cfg_attr(not(feature = "distributed"), allow(unused_variables))]
    fn settle(&self, device: &B::Device) {
        match &self.reduce {
            Reduce::Host(..) => {}
            #[cfg(feature = "distributed")]
            Reduce::Device { settle, .. } => settle(device),
        }
    }
}

/// The host rendezvous: one round per summed tensor.
struct HostSum {
    workers: usize,
    wait: Duration,
    state: Mutex<Round>,
    changed: Condvar,
}

#[derive(Default)]
struct Round {
    parts: Vec<Option<TensorData>>,
    sum: Option<Arc<TensorData>>,
    taken: usize,
    broken: bool,
}

impl HostSum {
    fn new(workers: usize, wait: Duration) -> Self {
        Self {
            workers,
            wait,
            state: Mutex::new(Round {
                parts: vec![None; workers],
                ..Round::default()
            }),
            changed: Condvar::new(),
        }
    }

    /// Worker `rank`'s part of this round; the round's sum (or `part`
    /// itself once the rendezvous is broken).
    fn sum(&self, rank: usize, part: TensorData) -> TensorData {
        let deadline = Instant::now() + self.wait;
        let mut state = self.state.lock().expect("the rendezvous lock");
        // The previous round ends when every worker took its sum.
        while !state.broken && (state.sum.is_some() || state.parts[rank].is_some()) {
            state = self.wait_until(state, deadline);
        }
        if state.broken {
            return part;
        }
        state.parts[rank] = Some(part);
        if state.parts.iter().all(Option::is_some) {
            let parts: Vec<TensorData> =
                state.parts.iter_mut().map(|p| p.take().unwrap()).collect();
            state.sum = Some(Arc::new(add_parts(&parts)));
            self.changed.notify_all();
        }
        while !state.broken && state.sum.is_none() {
            state = self.wait_until(state, deadline);
        }
        let Some(sum) = state.sum.clone() else {
            return state.parts[rank].take().expect("this worker's part");
        };
        state.taken += 1;
        if state.taken == self.workers {
            state.sum = None;
            state.taken = 0;
            self.changed.notify_all();
        }
        (*sum).clone()
    }

    fn wait_until<'a>(
        &self,
        state: std::sync::MutexGuard<'a, Round>,
        deadline: Instant,
    ) -> std::sync::MutexGuard<'a, Round> {
        let left = deadline.saturating_duration_since(Instant::now());
        let (mut state, timeout) = self
            .changed
            .wait_timeout(state, left)
            .expect("the rendezvous lock");
        if timeout.timed_out() && Instant::now() >= deadline {
            state.broken = true;
            self.changed.notify_all();
        }
        state
    }
}

/// The sums of the gradients, started while the backward passes run.
///
/// Every worker hands over its part of each segment (a module's completed
/// gradients) as soon as the segment's backward pass is queued, and goes
/// on; the worker that hands over a segment's last part starts that
/// segment's sums for every worker, so on every device they are queued in
/// one order (NCCL's calls must match across devices) and none waits for
/// a worker's thread (which may be held by another worker's autodiff
/// graph). At the end of its backward pass a worker takes its sums back.
struct SegmentSums<T> {
    state: Mutex<Segments<T>>,
    changed: Condvar,
}

struct Segments<T> {
    /// Segments some worker has not taken back; `open[0]` is number
    /// `first`.
    open: std::collections::VecDeque<Segment<T>>,
    first: usize,
    /// Segments each worker handed over.
    handed: Vec<usize>,
    /// Segments each worker took back.
    taken: Vec<usize>,
    /// Why the sums can no longer be trusted.
    broken: Option<String>,
}

struct Segment<T> {
    /// Each worker's part, then its sums.
    parts: Vec<Option<Vec<T>>>,
    summed: bool,
    /// Workers that took their sums back.
    taken: usize,
}

impl<T> SegmentSums<T> {
    fn new(workers: usize) -> Self {
        Self {
            state: Mutex::new(Segments {
                open: Default::default(),
                first: 0,
                handed: vec![0; workers],
                taken: vec![0; workers],
                broken: None,
            }),
            changed: Condvar::new(),
        }
    }

    /// Hands over worker `rank`'s part of its next segment; with the
    /// segment's last part, `sum` starts the sums of every worker's part
    /// (called with the lock held, so that segments are summed in order).
    fn hand_over(&self, rank: usize, part: Vec<T>, sum: impl FnOnce(Vec<Vec<T>>) -> Vec<Vec<T>>) {
        let mut state = self.state.lock().expect("the segment sums' lock");
        let state = &mut *state;
        let index = state.handed[rank] - state.first;
        state.handed[rank] += 1;
        while state.open.len() <= index {
            state.open.push_back(Segment {
                parts: (0..state.handed.len()).map(|_| None).collect(),
                summed: false,
                taken: 0,
            });
        }
        let segment = &mut state.open[index];
        segment.parts[rank] = Some(part);
        if state.broken.is_some() || segment.parts.iter().any(Option::is_none) {
            return;
        }
        let lengths: Vec<usize> = segment.parts.iter().flatten().map(Vec::len).collect();
        if lengths.iter().any(|&l| l != lengths[0]) {
            state.broken = Some(format!(
                "the workers' backward passes disagree: segment {} has {lengths:?} gradients on \
                 the workers",
                state.first + index
            ));
        } else {
            let parts = segment
                .parts
                .iter_mut()
                .map(|p| p.take().unwrap())
                .collect();
            for (slot, sums) in segment.parts.iter_mut().zip(sum(parts)) {
                *slot = Some(sums);
            }
            segment.summed = true;
        }
        self.changed.notify_all();
    }

    /// Worker `rank`'s parts of the segments it handed over since it last
    /// took some back, in order: their sums, once every worker handed
    /// over its part. A worker missing for longer than `wait` breaks the
    /// sums: the parts then come back as they are, and the reason stays
    /// in [`Self::broken`].
    fn take_back(&self, rank: usize, wait: Duration) -> Vec<Vec<T>> {
        let deadline = Instant::now() + wait;
        let mut state = self.state.lock().expect("the segment sums' lock");
        let (from, to) = (state.taken[rank], state.handed[rank]);
        while state.broken.is_none()
            && !state
                .open
                .range(from - state.first..to - state.first)
                .all(|s| s.summed)
        {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                state.broken = Some(format!(
                    "worker {rank} waited longer than {:.0} s for another worker's gradients",
                    wait.as_secs_f64()
                ));
                self.changed.notify_all();
                break;
            }
            state = self
                .changed
                .wait_timeout(state, left)
                .expect("the segment sums' lock")
                .0;
        }
        let first = state.first;
        let mut back = Vec::with_capacity(to - from);
        for segment in state.open.range_mut(from - first..to - first) {
            back.push(segment.parts[rank].take().unwrap_or_default());
            segment.taken += 1;
        }
        state.taken[rank] = to;
        let workers = state.handed.len();
        while state.open.front().is_some_and(|s| s.taken == workers) {
            state.open.pop_front();
            state.first += 1;
        }
        back
    }

    /// Breaks the sums: a worker failed before handing over its parts.
    fn abandon(&self, why: String) {
        let mut state = self.state.lock().expect("the segment sums' lock");
        state.broken.get_or_insert(why);
        self.changed.notify_all();
    }

    fn broken(&self) -> Option<String> {
        match self.state.lock() {
            Ok(state) => state.broken.clone(),
            Err(_) => Some("a worker panicked while it summed gradients".into()),
        }
    }
}

/// Every worker's copy of `combine` applied to each column of host parts
/// (part `i` of every worker, in worker order).
fn combine_on_host<B: Backend>(
    parts: Vec<Vec<Part<B>>>,
    combine: impl Fn(Vec<TensorData>) -> TensorData,
) -> Vec<Vec<Part<B>>> {
    let workers = parts.len();
    let count = parts.first().map_or(0, Vec::len);
    let mut by_worker: Vec<_> = parts.into_iter().map(Vec::into_iter).collect();
    let combined: Vec<TensorData> = (0..count)
        .map(|_| {
            let column = by_worker
                .iter_mut()
                .map(|p| match p.next() {
                    Some(Part::Host(data)) => data,
                    _ => unreachable!("a host sum holds a value for every part"),
                })
                .collect();
            combine(column)
        })
        .collect();
    (0..workers)
        .map(|_| combined.iter().cloned().map(Part::Host).collect())
        .collect()
}

/// The element-wise sum of same-shaped parts, in f32, in worker order.
fn add_parts(parts: &[TensorData]) -> TensorData {
    let shape = parts[0].shape.clone();
    let mut sum = vec![0f32; parts[0].num_elements()];
    for part in parts {
        let values = part.clone().convert::<f32>();
        let values = values.as_slice::<f32>().expect("f32 after conversion");
        for (s, v) in sum.iter_mut().zip(values) {
            *s += v;
        }
    }
    TensorData::new(sum, shape)
}

/// Settings of [`Trainer::data_parallel`].
#[derive(Clone, Debug)]
pub struct DataParallelOptions {
    /// The longest a step waits for another worker (its first step
    /// compiles the kernels, tens of seconds on a fresh machine) before it
    /// reports that worker as failed.
    pub wait: Duration,
}

impl Default for DataParallelOptions {
    fn default() -> Self {
        Self {
            wait: Duration::from_secs(600),
        }
    }
}

/// This worker's place among the workers.
pub(crate) struct World<B: AutodiffBackend> {
    pub(crate) collective: Collective<B::InnerBackend>,
    pub(crate) rank: usize,
    /// The longest this worker waits for another's part of a sum.
    pub(crate) wait: Duration,
    /// The stream this worker's gradient sums are queued on (one of its
    /// own, see [`Collective::part`]).
    pub(crate) hand_over: burn::tensor::StreamId,
    pub(crate) backend: PhantomData<fn() -> B>,
}

impl<B: AutodiffBackend> World<B> {
    /// The sum over the workers of a tensor of the training backend
    /// (detached: what it counts needs no gradient).
    ///
    /// The sum is settled before it is returned: work queued after the
    /// sum, and only that, waits for it (on CUDA, an operation queued
    /// between the all-reduce and the settling would read the tensor before
    /// the other workers' values arrive).
    pub(crate) fn sum<const D: usize>(&self, t: Tensor<B, D>) -> Tensor<B, D> {
        let device = t.device();
        let summed = self.sum_unsettled(t);
        self.settle(&device);
        summed
    }

    /// [`World::sum`] without the settling: nothing may read the sum
    /// before [`World::settle`] (other work queued meanwhile runs while
    /// the sum waits for the other workers).
    pub(crate) fn sum_unsettled<const D: usize>(&self, t: Tensor<B, D>) -> Tensor<B, D> {
        let device = t.device();
        let summed = Tensor::from_inner(self.collective.sum(self.rank, t.inner()));
        self.send_sums(&device);
        summed
    }

    /// Hands the sums queued on `device` to the device's thread at once,
    /// without ordering this worker's later work after them
    /// ([`Collective::send`], on the hand-over stream).
    pub(crate) fn send_sums(&self, device: &B::Device) {
        use burn::tensor::backend::DeviceOps;
        self.collective.send(device.inner(), self.hand_over);
    }

    /// True on every worker when it is true on any.
    pub(crate) fn any(&self, t: Tensor<B, 1, Bool>) -> Tensor<B, 1, Bool> {
        self.sum(t.float()).greater_elem(0.5)
    }

    /// Whether the gradients are summed during the backward pass
    /// ([`World::gradient_sums`]) rather than after it
    /// ([`World::sum_grads`]).
    pub(crate) fn sums_during_backward(&self) -> bool {
        self.collective.during_backward
    }

    /// Every trainable parameter's gradient summed over the workers (a
    /// parameter without a gradient here takes part with zeros, so every
    /// worker sums the same tensors in the same order), settled once after
    /// the last: nothing reads a gradient in between.
    pub(crate) fn sum_grads(
        &self,
        model: &CausalLm<B>,
        grads: GradientsParams,
        device: &B::Device,
    ) -> GradientsParams
    where
        CausalLm<B>: AutodiffModule<B>,
    {
        let mut visitor = SumGrads { world: self, grads };
        model.visit(&mut visitor);
        self.settle(device);
        visitor.grads
    }

    /// A sink for one backward pass's gradients: each completed segment's
    /// are handed over to the sums at once ([`SegmentSums`]);
    /// [`GradientSums::finish`] puts the sums back.
    pub(crate) fn gradient_sums(&self) -> GradientSums<'_, B> {
        GradientSums {
            world: self,
            handed: Vec::new(),
        }
    }

    /// Sends every operation queued on `device` so far to the device,
    /// without waiting for it to run, where the sums run on the device (a
    /// host rendezvous reads each sum back, which waits for it anyway).
    pub(crate) fn flush(&self, device: &B::Device) {
        // Settling drains Burn's fusion stream and CubeCL's queue (the
        // ordering after the sums it adds costs nothing: the operations
        // queued so far already follow them).
        self.settle(device);
    }

    /// Why the sums can no longer be trusted, if they cannot.
    pub(crate) fn broken(&self) -> Option<String> {
        self.collective.broken(self.wait)
    }

    /// Breaks the sums, so that no worker waits for this one's part of
    /// them: it failed before it handed over its gradients.
    pub(crate) fn abandon(&self, why: impl std::fmt::Display) {
        self.collective
            .segments
            .abandon(format!("worker {} failed: {why}", self.rank));
    }

    /// Makes `device`'s later work wait for the sums queued so far.
    pub(crate) fn settle(&self, device: &B::Device) {
        use burn::tensor::backend::DeviceOps;
        self.collective.settle(device.inner());
    }
}

struct SumGrads<'a, B: AutodiffBackend> {
    world: &'a World<B>,
    grads: GradientsParams,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for SumGrads<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if !param.is_require_grad() {
            return;
        }
        let grad = self
            .grads
            .remove::<B::InnerBackend, D>(param.id)
            .unwrap_or_else(|| param.val().inner().zeros_like());
        let summed = self.world.collective.sum(self.world.rank, grad);
        self.grads.register(param.id, summed);
    }
}

/// Hands the gradients of a segmented backward pass over to the sums as
/// they complete, and puts the sums back at its end.
pub(crate) struct GradientSums<'a, B: AutodiffBackend> {
    world: &'a World<B>,
    /// How to put each handed-over gradient back, in order.
    handed: Vec<Vec<PutBack<B>>>,
}

/// Registers a summed, flattened gradient under its parameter, in its
/// shape.
type RegisterSum<B> =
    Box<dyn FnOnce(Tensor<<B as AutodiffBackend>::InnerBackend, 1>, &mut GradientsParams)>;

/// How a handed-over part comes back into the gradients.
enum PutBack<B: AutodiffBackend> {
    /// One part, a summed gradient.
    Gradient(RegisterSum<B>),
    /// Two parts, every worker's lookup ids (f32) and output gradient rows
    /// (flattened), gathered: their rows are added to the embeddings'
    /// gradient `id` (zeros of `shape` and `dtype` when no other part of
    /// it is there).
    Lookup {
        id: burn::module::ParamId,
        shape: [usize; 2],
        dtype: burn::tensor::DType,
    },
}

impl<B: AutodiffBackend> SegmentSink<B> for GradientSums<'_, B> {
    fn completed<M: Module<B>>(&mut self, module: &M, grads: &mut GradientsParams) {
        let mut take = TakeCompleted {
            grads,
            flat: Vec::new(),
            put_back: Vec::new(),
        };
        module.visit(&mut take);
        let collective = &self.world.collective;
        let hand_over = self.world.hand_over;
        let part = take
            .flat
            .into_iter()
            .map(|t| collective.part(t, hand_over))
            .collect();
        collective
            .segments
            .hand_over(self.world.rank, part, |parts| collective.sum_segment(parts));
        self.handed.push(take.put_back);
    }

    /// Gathering every worker's ids and output gradient sums `workers ×
    /// tokens × (hidden + 1)` values (a slot per worker) instead of the
    /// `vocab × hidden` of the whole gradient (more only past `vocab /
    /// workers` tokens a worker, where the rest of the step grows as
    /// much), and the tied head's part need not wait for the last layer's
    /// backward pass. The ids travel as f32, exact up to 2^24.
    fn gathers_lookup(&self, vocab: usize) -> bool {
        vocab <= 1 << 24
    }

    fn lookup(
        &mut self,
        weight: &Param<Tensor<B, 2>>,
        ids: Tensor<B::InnerBackend, 2, Int>,
        dx: Tensor<B::InnerBackend, 3>,
    ) {
        use burn::tensor::TensorPrimitive;
        use burn::tensor::ops::IntTensorOps;
        let id = weight.id;
        let weight = weight.val();
        let [batch, seq, hidden] = dx.dims();
        let tokens = batch * seq;
        // The ids as f32 whatever the device's default float type: a
        // narrower one would round them.
        let ids = Tensor::<B::InnerBackend, 1>::from_primitive(TensorPrimitive::Float(
            B::InnerBackend::int_into_float(
                ids.reshape([tokens]).into_primitive(),
                burn::tensor::FloatDType::F32,
            ),
        ));
        let collective = &self.world.collective;
        let hand_over = self.world.hand_over;
        let part = vec![
            collective.part(ids, hand_over),
            collective.part(dx.reshape([tokens * hidden]), hand_over),
        ];
        collective
            .segments
            .hand_over(self.world.rank, part, |parts| {
                collective.gather_segment(parts)
            });
        self.handed.push(vec![PutBack::Lookup {
            id,
            shape: weight.dims(),
            dtype: weight.dtype(),
        }]);
    }
}

impl<B> GradientSums<'_, B>
where
    B: AutodiffBackend,
    B::InnerBackend: bastile::BastileBackend,
{
    /// Puts every handed-over gradient back into `grads` as its sum over
    /// the workers (waiting for the other workers' parts, at most the
    /// world's wait), after making `device`'s later work wait for the
    /// sums. A broken sum puts this worker's own gradients back (the step
    /// then fails: [`World::broken`]).
    pub(crate) fn finish(
        self,
        grads: &mut GradientsParams,
        device: &B::Device,
    ) -> Result<(), ModelError> {
        use burn::tensor::backend::DeviceOps;
        let world = self.world;
        let back = world.collective.segments.take_back(world.rank, world.wait);
        // The lookup's rows are added on this worker's compute stream,
        // which must see the gathered values.
        world.settle(device);
        for (sums, put_back) in back.into_iter().zip(self.handed) {
            let mut sums = sums.into_iter().map(|sum| match sum {
                Part::Host(data) => Tensor::from_data(data, device.inner()),
                Part::Device(t, _) => t,
            });
            for put in put_back {
                match put {
                    PutBack::Gradient(put) => match sums.next() {
                        Some(sum) => put(sum, grads),
                        None => break,
                    },
                    PutBack::Lookup { id, shape, dtype } => {
                        let (Some(ids), Some(rows)) = (sums.next(), sums.next()) else {
                            break;
                        };
                        let tokens = ids.dims()[0];
                        add_lookup_grad(
                            grads,
                            id,
                            || Tensor::zeros(shape, (device.inner(), dtype)),
                            ids.int().reshape([1, tokens]),
                            rows.reshape([1, tokens, shape[1]]),
                        )?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// Takes the gradients of a module's trainable parameters out of `grads`,
/// flattened, with how to put each back.
struct TakeCompleted<'a, B: AutodiffBackend> {
    grads: &'a mut GradientsParams,
    flat: Vec<Tensor<B::InnerBackend, 1>>,
    put_back: Vec<PutBack<B>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for TakeCompleted<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) else {
            return;
        };
        let (id, shape) = (param.id, grad.dims());
        self.flat
            .push(grad.reshape([shape.iter().product::<usize>()]));
        self.put_back
            .push(PutBack::Gradient(Box::new(move |sum, grads| {
                grads.register::<B::InnerBackend, D>(id, sum.reshape(shape));
            })));
    }
}

/// What a step's error came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cause {
    /// This worker: its batch, its device, or a value all workers share
    /// (the summed loss or gradient norm).
    Here,
    /// Another worker's batch: the summed skip flag was set while this
    /// worker's checks passed.
    Elsewhere,
    /// This worker, before it queued its collective operations: the
    /// others may wait for them forever.
    Early,
}

/// A worker's outcome of one step.
pub(crate) type Outcome = (Result<StepOutput, ModelError>, Cause);

/// A micro-batch on its way to another worker: already on that worker's
/// device, or as host data, read on worker 0's thread before its step is
/// queued, so that the other worker never reads worker 0's device (whose
/// queue may by then wait on that worker's collective operations).
enum Share<B: AutodiffBackend> {
    Placed(MicroBatch<B>),
    Host(Box<HostBatch>),
}

impl<B: AutodiffBackend> Share<B> {
    /// `through_host`: the batch must reach the worker as host data even
    /// on its device (worker 0 trains there too).
    fn new(m: MicroBatch<B>, device: &B::Device, through_host: bool) -> Result<Self, ModelError> {
        let on = |t: &Tensor<B, 2, Int>| t.device() == *device;
        if !through_host && on(&m.ids) && on(&m.labels) && m.positions.as_ref().is_none_or(on) {
            Ok(Self::Placed(m))
        } else {
            HostBatch::read(m).map(|h| Self::Host(Box::new(h)))
        }
    }

    fn on(self, device: &B::Device) -> MicroBatch<B> {
        match self {
            Self::Placed(m) => m,
            Self::Host(h) => h.upload(device),
        }
    }
}

struct HostBatch {
    ids: TensorData,
    labels: TensorData,
    positions: Option<TensorData>,
}

impl HostBatch {
    fn read<B: AutodiffBackend>(m: MicroBatch<B>) -> Result<Self, ModelError> {
        let read = |t: Tensor<B, 2, Int>| {
            t.try_into_data()
                .map_err(|e| ModelError::Device(format!("reading a micro-batch back: {e}")))
        };
        Ok(Self {
            ids: read(m.ids)?,
            labels: read(m.labels)?,
            positions: m.positions.map(read).transpose()?,
        })
    }

    fn upload<B: AutodiffBackend>(self, device: &B::Device) -> MicroBatch<B> {
        MicroBatch {
            ids: Tensor::from_data(self.ids, device),
            labels: Tensor::from_data(self.labels, device),
            positions: self.positions.map(|p| Tensor::from_data(p, device)),
        }
    }
}

/// A message to a worker thread.
enum Command<B: AutodiffBackend> {
    Step(Vec<Share<B>>),
    LoadState(std::path::PathBuf),
}

/// A worker thread's answer to a command.
enum Answer {
    /// Its replica is on its device.
    Ready,
    Stepped(Outcome),
    Loaded(Result<(), ModelError>),
}

/// Worker `rank` (≥ 1) on its own thread.
struct Peer<B: AutodiffBackend> {
    rank: usize,
    device: B::Device,
    /// Whether worker 0 trains on this device too: micro-batches on it
    /// reach this worker as host data (see [`OwnCopy`] for why).
    shares_trainer_device: bool,
    commands: Option<Sender<Command<B>>>,
    /// An answer, or why the thread could not give one (a panic).
    answers: Receiver<Result<Answer, String>>,
    thread: Option<JoinHandle<()>>,
}

/// The worker threads of a data-parallel [`Trainer`], and what it needs to
/// wait for them.
pub(crate) struct Peers<B: AutodiffBackend> {
    peers: Vec<Peer<B>>,
    wait: Duration,
    /// `(worker, message)` once a worker failed: every later step reports
    /// it.
    failed: Option<(usize, String)>,
    /// Whether the peers were sent a step they have not answered yet.
    stepping: bool,
    /// Their outcomes of the last step, once collected.
    collected: Option<Vec<Outcome>>,
}

impl<B> Trainer<B>
where
    B: AutodiffBackend + bastile::BastileBackend,
    B::InnerBackend: bastile::BastileBackend,
    CausalLm<B>: AutodiffModule<B>,
{
    /// Makes this trainer worker 0 of a data-parallel group over
    /// `devices`: `model` (on `devices[0]`, the device of the batches this
    /// trainer's steps get) is copied to every other device, where a
    /// worker thread trains the copy. Call it before the first step, with
    /// the model that step will get (after loading a checkpoint), and
    /// before [`Trainer::load_state`], which then loads every worker's
    /// state.
    ///
    /// Each [`Trainer::step`] then takes the micro-batches of all workers:
    /// their number must be a multiple of the workers', and worker `k` gets
    /// the `k`-th equal, consecutive share: micro-batches already on that
    /// worker's device as they are, others read back and uploaded (which
    /// waits for worker 0's device). Returns once every replica is on its
    /// device. An error when
    /// the collective is not for `devices.len()` workers, when `devices` is
    /// empty, after a step, or when a worker cannot start.
    pub fn data_parallel(
        mut self,
        model: &CausalLm<B>,
        devices: &[B::Device],
        collective: Collective<B::InnerBackend>,
        options: DataParallelOptions,
    ) -> Result<Self, ModelError>
    where
        B: 'static,
        CausalLm<B>: Send + 'static,
        MicroBatch<B>: Send,
    {
        if devices.is_empty() {
            return Err(ModelError::Config(
                "data-parallel training needs at least one device".into(),
            ));
        }
        if collective.workers() != devices.len() {
            return Err(ModelError::Config(format!(
                "the collective is for {} workers, but {} devices were given",
                collective.workers(),
                devices.len()
            )));
        }
        if self.steps() > 0 || self.world.is_some() {
            return Err(ModelError::Config(
                "a trainer becomes data-parallel once, before its first step".into(),
            ));
        }
        if self.has_step_graphs() {
            return Err(ModelError::Config(
                "step graphs train on one device, not data-parallel".into(),
            ));
        }
        let mut peers = Vec::with_capacity(devices.len() - 1);
        for (rank, device) in devices.iter().enumerate().skip(1) {
            let (commands, inbox) = channel::<Command<B>>();
            let (outbox, answers) = channel();
            let config = self.config.clone();
            let world = World {
                collective: collective.clone(),
                rank,
                wait: options.wait,
                hand_over: new_stream()?,
                backend: PhantomData,
            };
            let replica = model.clone();
            let on = device.clone();
            let shares_trainer_device = *device == devices[0];
            let thread = std::thread::Builder::new()
                .name(format!("bastile-worker-{rank}"))
                .spawn(move || {
                    serve(
                        config,
                        world,
                        replica,
                        on,
                        shares_trainer_device,
                        inbox,
                        outbox,
                    )
                })
                .map_err(|e| ModelError::Worker {
                    worker: rank,
                    message: format!("its thread could not start: {e}"),
                })?;
            peers.push(Peer {
                rank,
                device: device.clone(),
                shares_trainer_device,
                commands: Some(commands),
                answers,
                thread: Some(thread),
            });
        }
        self.world = Some(World {
            collective,
            rank: 0,
            wait: options.wait,
            hand_over: new_stream()?,
            backend: PhantomData,
        });
        let mut peers = Peers {
            peers,
            wait: options.wait,
            failed: None,
            stepping: false,
            collected: None,
        };
        // Each replica is copied from this device: the copies finish before
        // the first step, whose collective operations may hold it.
        for (rank, answer) in peers.answers(None)? {
            if !matches!(answer, Answer::Ready) {
                return Err(peers.fail(rank, "it answered another command".into()));
            }
        }
        self.peers = Some(peers);
        Ok(self)
    }

    /// Workers training together (1 unless data-parallel).
    pub fn workers(&self) -> usize {
        self.peers.as_ref().map_or(1, |p| p.peers.len() + 1)
    }
}

/// A stream id no thread runs on: the id a new thread gets.
fn new_stream() -> Result<burn::tensor::StreamId, ModelError> {
    std::thread::spawn(burn::tensor::StreamId::current)
        .join()
        .map_err(|_| {
            ModelError::Device("a thread to name a stream for the gradient sums panicked".into())
        })
}

/// Replaces every float parameter by a copy made on the calling thread
/// (read back and uploaded: exact, and created on this thread's fusion
/// stream), keeping whether it requires a gradient.
///
/// For a worker on the device the trainer trains on: there `fork` would
/// hand the worker the model's own buffers, which its stream and the
/// trainer's would both read and consume, and Burn's fusion streams do not
/// order one stream's queued reads before another stream's last use of a
/// tensor.
struct OwnCopy;

impl<B: Backend> ModuleMapper<B> for OwnCopy {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        param.map(|t| {
            let require_grad = t.is_require_grad();
            let copy = Tensor::from_data(t.to_data(), &t.device());
            if require_grad {
                copy.require_grad()
            } else {
                copy
            }
        })
    }
}

/// A worker thread: trains its replica on the shares it is sent until the
/// trainer that started it is dropped, or a command panics. On the
/// trainer's device (`shares_trainer_device`) the replica is a copy of its
/// own (see [`OwnCopy`]).
fn serve<B>(
    config: crate::TrainConfig,
    world: World<B>,
    replica: CausalLm<B>,
    device: B::Device,
    shares_trainer_device: bool,
    inbox: Receiver<Command<B>>,
    outbox: Sender<Result<Answer, String>>,
) where
    B: AutodiffBackend + bastile::BastileBackend,
    B::InnerBackend: bastile::BastileBackend,
    CausalLm<B>: AutodiffModule<B>,
{
    let ready = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let model = if shares_trainer_device {
            replica.map(&mut OwnCopy)
        } else {
            replica.fork(&device)
        };
        B::sync(&device)
            .map(|()| model)
            .map_err(|e| format!("copying the model to {device:?} failed: {e}"))
    }));
    let mut model = match ready
        .map_err(|panic| panic_message(&*panic))
        .and_then(|r| r)
    {
        Ok(model) => Some(model),
        Err(message) => {
            let _ = outbox.send(Err(message));
            return;
        }
    };
    let mut trainer = match Trainer::<B>::new(config) {
        Ok(mut t) => {
            t.world = Some(world);
            Some(t)
        }
        Err(e) => {
            let _ = outbox.send(Err(e.to_string()));
            return;
        }
    };
    if outbox.send(Ok(Answer::Ready)).is_err() {
        return;
    }
    while let Ok(command) = inbox.recv() {
        let answer = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match command {
            Command::Step(share) => {
                let share: Vec<MicroBatch<B>> = share.into_iter().map(|m| m.on(&device)).collect();
                let t = trainer.as_mut().expect("the worker's trainer");
                let (m, out, cause) = t.step_here(model.take().expect("the replica"), &share);
                model = Some(m);
                Answer::Stepped((out, cause))
            }
            Command::LoadState(dir) => {
                let t = trainer.take().expect("the worker's trainer");
                match t.load_state(&dir, &device) {
                    Ok(t) => {
                        trainer = Some(t);
                        Answer::Loaded(Ok(()))
                    }
                    Err(e) => Answer::Loaded(Err(e)),
                }
            }
        }));
        let answer = answer.map_err(|panic| panic_message(&*panic));
        if let (Err(message), Some(world)) =
            (&answer, trainer.as_ref().and_then(|t| t.world.as_ref()))
        {
            // The others would wait for this worker's gradients.
            world.abandon(message);
        }
        let unusable = answer.is_err() || trainer.is_none();
        if outbox.send(answer).is_err() || unusable {
            return;
        }
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    match (panic.downcast_ref::<&str>(), panic.downcast_ref::<String>()) {
        (Some(s), _) => format!("it panicked: {s}"),
        (_, Some(s)) => format!("it panicked: {s}"),
        _ => "it panicked".into(),
    }
}

impl<B: AutodiffBackend> Peers<B> {
    /// The error of a worker that failed earlier.
    pub(crate) fn failure(&self) -> Option<ModelError> {
        self.failed
            .as_ref()
            .map(|(worker, message)| ModelError::Worker {
                worker: *worker,
                message: message.clone(),
            })
    }

    /// Workers, this one included.
    pub(crate) fn workers(&self) -> usize {
        self.peers.len() + 1
    }

    /// Sends each peer its share of a step (`shares[k]` to worker `k + 1`);
    /// a micro-batch on another device than the peer's, or on worker 0's,
    /// is read back first.
    pub(crate) fn send_shares(
        &mut self,
        shares: Vec<Vec<MicroBatch<B>>>,
    ) -> Result<(), ModelError> {
        let mut read = Vec::with_capacity(shares.len());
        for (peer, share) in self.peers.iter().zip(shares) {
            read.push(
                share
                    .into_iter()
                    .map(|m| Share::new(m, &peer.device, peer.shares_trainer_device))
                    .collect::<Result<Vec<_>, _>>()?,
            );
        }
        for (i, share) in read.into_iter().enumerate() {
            let rank = self.peers[i].rank;
            if !self.peers[i].send(Command::Step(share)) {
                return Err(self.fail(rank, "its thread stopped".into()));
            }
        }
        self.stepping = true;
        Ok(())
    }

    /// Waits (once per step) for every peer's outcome of the step sent
    /// last, each within the wait; a peer that failed or stayed silent is
    /// the run's error.
    pub(crate) fn collect(&mut self, step: usize) -> Result<(), ModelError> {
        if std::mem::take(&mut self.stepping) {
            let mut outcomes = Vec::with_capacity(self.peers.len());
            for (rank, answer) in self.answers(Some(step))? {
                match answer {
                    Answer::Stepped((Err(e), Cause::Early)) => {
                        return Err(self.fail(rank, e.to_string()));
                    }
                    Answer::Stepped(outcome) => outcomes.push(outcome),
                    Answer::Loaded(_) | Answer::Ready => {
                        return Err(self.fail(rank, "it answered another command".into()));
                    }
                }
            }
            self.collected = Some(outcomes);
        }
        match self.failure() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Whether the peers still owe an answer to the step sent last.
    pub(crate) fn stepping(&self) -> bool {
        self.stepping
    }

    /// The outcomes [`Self::collect`] gathered.
    pub(crate) fn take_outcomes(&mut self, step: usize) -> Result<Vec<Outcome>, ModelError> {
        self.collect(step)?;
        Ok(self.collected.take().unwrap_or_default())
    }

    /// Asks every peer to load its trainer state from `dir`, and waits.
    pub(crate) fn load_state(&mut self, dir: &std::path::Path) -> Result<(), ModelError> {
        if let Some(e) = self.failure() {
            return Err(e);
        }
        for i in 0..self.peers.len() {
            if !self.peers[i].send(Command::LoadState(dir.to_path_buf())) {
                let rank = self.peers[i].rank;
                return Err(self.fail(rank, "its thread stopped".into()));
            }
        }
        for (rank, answer) in self.answers(None)? {
            match answer {
                Answer::Loaded(Ok(())) => {}
                Answer::Loaded(Err(e)) => return Err(e.on_worker(rank)),
                Answer::Stepped(_) | Answer::Ready => {
                    return Err(self.fail(rank, "it answered another command".into()));
                }
            }
        }
        Ok(())
    }

    /// Every peer's answer to the last command, in rank order, within the
    /// wait from now.
    fn answers(&mut self, step: Option<usize>) -> Result<Vec<(usize, Answer)>, ModelError> {
        if let Some(e) = self.failure() {
            return Err(e);
        }
        let deadline = Instant::now() + self.wait;
        let mut all = Vec::with_capacity(self.peers.len());
        for i in 0..self.peers.len() {
            let rank = self.peers[i].rank;
            let left = deadline.saturating_duration_since(Instant::now());
            let message = match self.peers[i].answers.recv_timeout(left) {
                Ok(Ok(answer)) => {
                    all.push((rank, answer));
                    continue;
                }
                Ok(Err(message)) => message,
                Err(RecvTimeoutError::Timeout) => format!(
                    "no answer{} within {:.0} s (a collective operation it waits on may never \
                     complete)",
                    step.map_or(String::new(), |s| format!(" to step {s}")),
                    self.wait.as_secs_f64(),
                ),
                Err(RecvTimeoutError::Disconnected) => "its thread stopped".into(),
            };
            return Err(self.fail(rank, message));
        }
        Ok(all)
    }

    /// Records worker `rank`'s failure and returns it as the error.
    fn fail(&mut self, rank: usize, message: String) -> ModelError {
        self.record_failure(rank, message);
        self.failure().expect("just recorded")
    }

    /// Records that the step failed on worker 0 in a way the others may
    /// never finish (before its collective operations were queued), unless
    /// a failure is recorded already.
    pub(crate) fn fail_here(&mut self, e: &ModelError) {
        if self.failed.is_none() {
            self.record_failure(0, e.to_string());
        }
    }

    fn record_failure(&mut self, rank: usize, message: String) {
        let message = format!("{message}; training stops, since the replicas may now differ");
        self.failed = Some((rank, message));
    }
}

impl<B: AutodiffBackend> Peer<B> {
    /// Sends `command`; false when the thread is gone.
    fn send(&self, command: Command<B>) -> bool {
        self.commands
            .as_ref()
            .is_some_and(|c| c.send(command).is_ok())
    }
}

impl<B: AutodiffBackend> Drop for Peer<B> {
    fn drop(&mut self) {
        // Closing the channel ends the thread's loop; a thread stuck on
        // the device is left behind rather than waited for.
        self.commands = None;
        if let Some(thread) = self.thread.take()
            && thread.is_finished()
        {
            let _ = thread.join();
        }
    }
}

/// The step's result from every worker's outcome: success when all
/// succeeded; else worker 0's own error, else the first other worker's own
/// error (naming it).
pub(crate) fn combine(own: Outcome, peers: Vec<Outcome>) -> Result<StepOutput, ModelError> {
    let (own, own_cause) = own;
    let own = match own {
        Ok(out) if peers.iter().all(|(r, _)| r.is_ok()) => return Ok(out),
        Ok(_) => None,
        Err(e) if own_cause != Cause::Elsewhere => return Err(e),
        Err(e) => Some(e),
    };
    for (rank, (out, cause)) in peers.into_iter().enumerate() {
        if let (Err(e), Cause::Here | Cause::Early) = (out, cause) {
            return Err(e.on_worker(rank + 1));
        }
    }
    Err(own.unwrap_or_else(|| ModelError::Worker {
        worker: 0,
        message: "the workers disagree on whether the step applied; training stops".into(),
    }))
}

/// Splits `batches` into `workers` equal consecutive shares; an error
/// when they do not divide.
pub(crate) fn shares<T>(batches: Vec<T>, workers: usize) -> Result<Vec<Vec<T>>, ModelError> {
    if batches.is_empty() || !batches.len().is_multiple_of(workers) {
        return Err(ModelError::Config(format!(
            "a data-parallel step needs a positive multiple of {workers} micro-batches (one \
             share per worker), got {}",
            batches.len()
        )));
    }
    let per = batches.len() / workers;
    let mut rest = batches.into_iter();
    Ok((0..workers)
        .map(|_| rest.by_ref().take(per).collect())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_are_equal_and_consecutive() {
        let s = shares((0..6).collect(), 3).unwrap();
        assert_eq!(s, vec![vec![0, 1], vec![2, 3], vec![4, 5]]);
        let e = shares((0..5).collect::<Vec<i32>>(), 2).unwrap_err();
        assert!(e.to_string().contains("multiple of 2"), "{e}");
        assert!(shares(Vec::<i32>::new(), 1).is_err());
    }

    #[test]
    fn host_sum_adds_every_worker_part_each_round() {
        let sum = Arc::new(HostSum::new(3, Duration::from_secs(20)));
        let threads: Vec<_> = (0..3)
            .map(|rank| {
                let sum = sum.clone();
                std::thread::spawn(move || {
                    (0..4)
                        .map(|round| {
                            let part =
                                TensorData::new(vec![rank as f32 + 10.0 * round as f32, 1.0], [2]);
                            sum.sum(rank, part).into_vec::<f32>().unwrap()
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for t in threads {
            let rounds = t.join().unwrap();
            for (round, got) in rounds.iter().enumerate() {
                // 0 + 1 + 2 plus 10·round from each of the three workers.
                assert_eq!(got, &vec![3.0 + 30.0 * round as f32, 3.0]);
            }
        }
    }

    /// Three workers hand over four segments each, at their own pace; a
    /// segment is summed once, by whichever worker came last, and in
    /// segment order.
    #[test]
    fn segment_sums_start_in_order_once_every_part_is_in() {
        let sums = Arc::new(SegmentSums::<f64>::new(3));
        let order = Arc::new(Mutex::new(Vec::new()));
        let threads: Vec<_> = (0..3)
            .map(|rank| {
                let (sums, order) = (sums.clone(), order.clone());
                std::thread::spawn(move || {
                    let mut back = Vec::new();
                    for segment in 0..4 {
                        std::thread::sleep(Duration::from_millis((rank * 3 + segment) as u64 % 5));
                        let part = vec![rank as f64 + 10.0 * segment as f64; segment + 1];
                        sums.hand_over(rank, part, |parts| {
                            order.lock().unwrap().push(segment);
                            let total: Vec<f64> = (0..parts[0].len())
                                .map(|i| parts.iter().map(|p| p[i]).sum())
                                .collect();
                            vec![total; parts.len()]
                        });
                        if segment % 2 == 1 {
                            back.extend(sums.take_back(rank, Duration::from_secs(20)));
                        }
                    }
                    back
                })
            })
            .collect();
        for t in threads {
            let back = t.join().unwrap();
            assert_eq!(back.len(), 4);
            for (segment, got) in back.iter().enumerate() {
                // 0 + 1 + 2 plus 10·segment from each worker.
                assert_eq!(got, &vec![3.0 + 30.0 * segment as f64; segment + 1]);
            }
        }
        assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3]);
        let state = sums.state.lock().unwrap();
        assert!(state.open.is_empty() && state.first == 4 && state.broken.is_none());
    }

    #[test]
    fn segment_sums_give_up_on_a_missing_or_failed_worker() {
        let sum = |_: Vec<Vec<f64>>| -> Vec<Vec<f64>> { panic!("a part is missing") };
        let sums = SegmentSums::<f64>::new(2);
        sums.hand_over(0, vec![5.0], sum);
        // This worker's own part comes back, and the sums stay broken.
        assert_eq!(
            sums.take_back(0, Duration::from_millis(50)),
            vec![vec![5.0]]
        );
        let why = sums.broken().unwrap();
        assert!(why.contains("worker 0 waited longer than"), "{why}");

        let sums = Arc::new(SegmentSums::<f64>::new(2));
        let waiting = {
            let sums = sums.clone();
            std::thread::spawn(move || {
                sums.hand_over(0, vec![1.0, 2.0], sum);
                let started = Instant::now();
                (
                    sums.take_back(0, Duration::from_secs(600)),
                    started.elapsed(),
                )
            })
        };
        std::thread::sleep(Duration::from_millis(20));
        sums.abandon("worker 1 failed: a label out of range".into());
        let (back, waited) = waiting.join().unwrap();
        assert_eq!(back, vec![vec![1.0, 2.0]]);
        assert!(waited < Duration::from_secs(60), "{waited:?}");
        assert!(sums.broken().unwrap().contains("worker 1 failed"));
    }

    #[test]
    fn segment_sums_refuse_parts_of_different_lengths() {
        let sums = SegmentSums::<f64>::new(2);
        let sum = |p: Vec<Vec<f64>>| p;
        sums.hand_over(0, vec![1.0, 2.0], sum);
        sums.hand_over(1, vec![1.0], sum);
        let why = sums.broken().unwrap();
        assert!(why.contains("segment 0 has [2, 1] gradients"), "{why}");
        assert_eq!(sums.take_back(1, Duration::from_secs(1)), vec![vec![1.0]]);
    }

    #[test]
    fn host_sum_gives_up_on_a_missing_worker() {
        let sum = HostSum::new(2, Duration::from_millis(50));
        let part = TensorData::new(vec![5f32], [1]);
        let got = sum.sum(0, part).into_vec::<f32>().unwrap();
        assert_eq!(got, vec![5.0]);
        assert!(sum.state.lock().unwrap().broken);
    }
}
