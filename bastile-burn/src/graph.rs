//! A training step's GPU work recorded once and replayed (CUDA graphs):
//! each later step is a few graph launches instead of the host queueing
//! every kernel again. Through Burn's autodiff and CubeCL a kernel costs
//! the host about 30 µs, more than many of a step's kernels take on the
//! GPU, so a short step waits on the host; a replayed one does not.
//!
//! Recording needs the kernels on CubeCL's CUDA runtime with every op
//! handed to CubeCL when it is called: `Autodiff<Bastile<CudaDirect>>`
//! (`burn::backend::Cuda` holds ops back in Burn's fusion stream), and
//! CUPTI on the library path. [`begin_capture`] starts recording what the
//! calling thread queues on the device, [`end_capture`] closes it into a
//! [`StepGraph`]; nothing runs while recording, so a recorded step is then
//! launched to run. Run the steps inside a [`GraphStream`] of their own.
//!
//! A replay repeats the recorded kernels on the recorded buffers. What a
//! step reads from outside itself must therefore stay where it was: the
//! parameters and optimizer state are updated in place (Bastile's
//! [`crate::optim::AdamW`] does so), each step's inputs are copied into
//! the recorded input tensors ([`copy_into`]), and what changes from step
//! to step on the host (the optimizer's step size) is written into the
//! device buffer the step reads it from.

use std::sync::{Arc, Mutex};

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Device, Int, Tensor};
use burn_cubecl::tensor::CubeTensor;

use crate::fused::{DeviceQuery, kernel};
use crate::{BastileBackend, BastileError};

/// One step's GPU work, recorded by [`begin_capture`] and
/// [`end_capture`], ready to replay with [`StepGraph::launch`].
pub struct StepGraph {
    #[cfg(feature = "cuda")]
    graph: bastile_cubecl::cuda_graph::StepGraph,
}

impl std::fmt::Debug for StepGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        #[cfg(feature = "cuda")]
        return self.graph.fmt(f);
        #[cfg(not(feature = "cuda"))]
        f.write_str("StepGraph")
    }
}

impl StepGraph {
    /// Queues the recorded work on the device after everything queued
    /// before it; returns without waiting for it.
    pub fn launch(&self) -> Result<(), BastileError> {
        #[cfg(feature = "cuda")]
        return self.graph.launch().map_err(graph_error);
        #[cfg(not(feature = "cuda"))]
        unreachable!("a step graph exists only with the `cuda` feature")
    }

    /// The kernel launches one replay makes.
    pub fn kernels(&self) -> usize {
        #[cfg(feature = "cuda")]
        return self.graph.kernels;
        #[cfg(not(feature = "cuda"))]
        0
    }
}

#[cfg(feature = "cuda")]
fn graph_error(e: bastile_cubecl::KernelError) -> BastileError {
    BastileError::Graph(e.to_string())
}

fn unsupported() -> BastileError {
    BastileError::Graph(
        "recording a step needs Bastile's kernels on CUDA with ops issued as they are called \
         (`Autodiff<Bastile<bastile::CudaDirect>>`, feature `cuda`)"
            .into(),
    )
}

/// Starts or ends the recording of the calling thread's work.
#[derive(Clone, Copy)]
enum Capture {
    Begin,
    End,
}

impl DeviceQuery for Capture {
    type Answer = Result<Option<StepGraph>, BastileError>;

    fn ask<R: burn_cubecl::CubeRuntime>(&self, device: &R::Device) -> Self::Answer {
        #[cfg(feature = "cuda")]
        {
            use bastile_cubecl::cuda_graph;
            let client = R::client(device);
            let (client, index) = crate::backend::matmul::cuda_client::<R>(&client, device)
                .ok_or_else(unsupported)?;
            match self {
                Capture::Begin => cuda_graph::begin(client, index)
                    .map(|()| None)
                    .map_err(graph_error),
                Capture::End => cuda_graph::end(client, index)
                    .map(|graph| Some(StepGraph { graph }))
                    .map_err(graph_error),
            }
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (self, device);
            Err(unsupported())
        }
    }
}

/// Starts recording the GPU work the calling thread queues on `device`
/// (run the step once or twice before, so that every kernel is compiled
/// and tuned and the memory pools hold what a step needs).
pub fn begin_capture<B: BastileBackend>(device: &Device<B>) -> Result<(), BastileError> {
    B::ask_in_order(device, &Capture::Begin)
        .ok_or_else(unsupported)?
        .map(|_| ())
}

/// Ends the recording [`begin_capture`] started: the work as a
/// [`StepGraph`], or why it cannot be replayed (an allocation or a host
/// wait inside it, an op on another stream).
pub fn end_capture<B: BastileBackend>(device: &Device<B>) -> Result<StepGraph, BastileError> {
    B::ask_in_order(device, &Capture::End)
        .ok_or_else(unsupported)?
        .map(|graph| graph.expect("an ended capture gives a graph"))
}

/// Where a kernel run for its effect ([`BastileBackend::run_in_order`],
/// which returns no value) leaves its outcome for the caller.
type Outcome<T> = Arc<Mutex<Option<Result<T, BastileError>>>>;

fn set<T>(outcome: &Outcome<T>, value: Result<T, BastileError>) {
    *outcome.lock().unwrap_or_else(|p| p.into_inner()) = Some(value);
}

/// Runs the kernel `make` builds around an [`Outcome`] on `B`, on
/// `floats` and `ints`, and returns what the kernel left there.
fn run_for_outcome<B: BastileBackend, K: crate::fused::Kernel, T>(
    make: impl FnOnce(Outcome<T>) -> K,
    floats: Vec<FloatTensor<B>>,
    ints: Vec<IntTensor<B>>,
) -> Result<T, BastileError> {
    let outcome: Outcome<T> = Arc::new(Mutex::new(None));
    let kernel = make(outcome.clone());
    B::run_in_order(&kernel, floats, ints).ok_or_else(unsupported)?;
    let value = outcome.lock().unwrap_or_else(|p| p.into_inner()).take();
    value.unwrap_or_else(|| Err(unsupported()))
}

/// Copies the second tensor into the first one's buffer (floats, or ints
/// with `ints`), ordered on the device after everything queued before.
#[derive(Clone, Debug)]
struct CopyInto {
    ints: bool,
    outcome: Outcome<()>,
}

kernel!(CopyInto, "bastile_copy_into", |op, floats, ints| {
    let pair = if op.ints { ints } else { floats };
    set(&op.outcome, copy_buffer(pair));
    Vec::new()
});

/// `[dst, src]`: `src`'s elements into `dst`'s buffer, byte for byte once
/// both have the same layout (CubeCL may pad the rows of a matrix it
/// allocates; `src` is laid out as a new tensor when it differs).
fn copy_buffer<R: burn_cubecl::CubeRuntime>(pair: Vec<CubeTensor<R>>) -> Result<(), BastileError> {
    let [dst, mut src] = crate::fused::unpack(pair);
    if src.meta.strides() != dst.meta.strides() {
        src = burn_cubecl::kernel::into_contiguous(src);
    }
    if src.meta.strides() != dst.meta.strides()
        || src.handle.size_in_used() != dst.handle.size_in_used()
    {
        return Err(BastileError::Shape(format!(
            "the recorded tensor's layout (strides {:?}, {} bytes) is not a new tensor's \
             (strides {:?}, {} bytes)",
            dst.meta.strides(),
            dst.handle.size_in_used(),
            src.meta.strides(),
            src.handle.size_in_used()
        )));
    }
    #[cfg(feature = "cuda")]
    {
        let (client, index) = crate::backend::matmul::cuda_client::<R>(&dst.client, &dst.device)
            .ok_or_else(unsupported)?;
        bastile_cubecl::cuda_graph::copy(
            client,
            index,
            &src.handle.clone().binding(),
            &dst.handle.clone().binding(),
            dst.handle.size_in_used() as usize,
        )
        .map_err(graph_error)
    }
    #[cfg(not(feature = "cuda"))]
    Err(unsupported())
}

/// Copies `src` into the buffer of `dst` (a tensor a recorded step reads),
/// ordered after every op queued before on the device: how a replayed
/// step receives new inputs. Same shape and dtype; on the backends
/// [`begin_capture`] takes. [`copy_ints_into`] for int tensors.
pub fn copy_into<B: BastileBackend, const D: usize>(
    dst: &Tensor<B, D>,
    src: Tensor<B, D>,
) -> Result<(), BastileError> {
    check_pair(dst.dims(), dst.dtype(), src.dims(), src.dtype())?;
    let floats = vec![
        dst.clone().into_primitive().tensor(),
        src.into_primitive().tensor(),
    ];
    run_copy::<B>(false, floats, Vec::new())
}

/// [`copy_into`] for int tensors (token ids, labels, positions).
pub fn copy_ints_into<B: BastileBackend, const D: usize>(
    dst: &Tensor<B, D, Int>,
    src: Tensor<B, D, Int>,
) -> Result<(), BastileError> {
    check_pair(dst.dims(), dst.dtype(), src.dims(), src.dtype())?;
    let ints = vec![dst.clone().into_primitive(), src.into_primitive()];
    run_copy::<B>(true, Vec::new(), ints)
}

fn check_pair<const D: usize>(
    dst: [usize; D],
    dst_dtype: DType,
    src: [usize; D],
    src_dtype: DType,
) -> Result<(), BastileError> {
    if dst != src || dst_dtype != src_dtype {
        return Err(BastileError::Shape(format!(
            "copying {src:?} {src_dtype:?} into {dst:?} {dst_dtype:?}"
        )));
    }
    Ok(())
}

fn run_copy<B: BastileBackend>(
    ints: bool,
    floats: Vec<FloatTensor<B>>,
    int_tensors: Vec<IntTensor<B>>,
) -> Result<(), BastileError> {
    run_for_outcome::<B, _, _>(|outcome| CopyInto { ints, outcome }, floats, int_tensors)
}

/// Reads the device addresses of the float tensors' buffers (their views'
/// starts).
#[derive(Clone, Debug)]
struct Addresses {
    outcome: Outcome<Vec<u64>>,
}

kernel!(Addresses, "bastile_buffer_addresses", |op, floats, _| {
    set(&op.outcome, addresses(floats));
    Vec::new()
});

fn addresses<R: burn_cubecl::CubeRuntime>(
    tensors: Vec<CubeTensor<R>>,
) -> Result<Vec<u64>, BastileError> {
    #[cfg(feature = "cuda")]
    {
        let Some(first) = tensors.first() else {
            return Ok(Vec::new());
        };
        let (_, index) = crate::backend::matmul::cuda_client::<R>(&first.client, &first.device)
            .ok_or_else(unsupported)?;
        let buffers = tensors.iter().map(|t| t.handle.clone().binding()).collect();
        bastile_cubecl::cuda_graph::addresses(index, buffers).map_err(graph_error)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = tensors;
        Err(unsupported())
    }
}

/// The device addresses of the buffers behind `tensors`: a recorded step
/// must find its parameters where it wrote them, so a caller compares
/// them before and after the step it records.
pub fn buffer_addresses<B: BastileBackend>(
    tensors: Vec<FloatTensor<B>>,
) -> Result<Vec<u64>, BastileError> {
    run_for_outcome::<B, _, _>(|outcome| Addresses { outcome }, tensors, Vec::new())
}

/// A CubeCL stream of its own for the ops run inside [`GraphStream::run`]:
/// its own CUDA stream and its own memory pool. A recorded step reuses,
/// at every replay, the memory its intermediate values had when it was
/// recorded; on a stream of its own, no tensor the program makes between
/// replays (on its own stream) can be given that memory and overwritten.
#[derive(Clone, Copy, Debug)]
pub struct GraphStream(cubecl::stream_id::StreamId);

impl GraphStream {
    /// A stream no thread uses yet (CubeCL numbers its streams by the
    /// threads that first use it; a thread that has only asked for its
    /// number gives one nothing else has).
    pub fn new() -> Self {
        let id = std::thread::spawn(cubecl::stream_id::StreamId::current)
            .join()
            .expect("a thread that only reads its stream id");
        Self(id)
    }

    /// Runs `f` with every op it queues on this stream.
    pub fn run<T>(&self, f: impl FnOnce() -> T) -> T {
        self.0.executes(f)
    }
}

impl Default for GraphStream {
    fn default() -> Self {
        Self::new()
    }
}
