//! Ordering the work of CUDA libraries (cuBLASLt, cuDNN) against CubeCL's
//! stream, and the CUDA context they share with it.
//!
//! Preferred: the library call is enqueued on the very CUDA stream CubeCL
//! uses for the caller's stream id ([`stream_probe`]), from CubeCL's device
//! thread as one of its tasks, so CUDA orders it after every kernel CubeCL
//! issued before (the tasks queued before it) and before every later one,
//! including one that reuses a freed operand's memory (the task holds the
//! operands until the call is enqueued); the host never waits. The task
//! holds its buffers as bindings, as CubeCL's own queued kernels do, not
//! as handles: a handle held there would count as a second owner, and
//! every later op on the call's output or operands (an in-place add, a
//! product summed into its output) would allocate a copy instead of
//! writing in place, until the device thread reached the task. A write in
//! place queued after the call runs after it on the same stream.
//!
//! Fallback, when that stream cannot be observed (CUPTI missing or held by
//! a profiler) or `BASTILE_MATMUL_ORDER=host-sync` is set: the call runs on
//! the library's own stream between two host synchronizations.

mod stream_probe;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cubecl::Runtime;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::device::Device;
use cubecl::device_handle::DeviceHandle;
use cubecl::prelude::ComputeClient;
use cubecl::server::{Binding, ComputeServer, Handle};
use cubecl::stream_id::StreamId;
use cudarc::driver::result as drv;
use cudarc::driver::sys::{CUcontext, CUstream};

use crate::KernelError;

/// How a call is ordered against CubeCL's work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OrderMode {
    /// Enqueued on CubeCL's own stream.
    SameStream,
    /// Host synchronization before and after, on the library's own stream.
    HostSync,
}

static FORCE_HOST_SYNC: AtomicBool = AtomicBool::new(false);

/// Forces [`OrderMode::HostSync`] (for comparison and debugging); the
/// environment variable `BASTILE_MATMUL_ORDER=host-sync` does the same.
pub fn force_host_sync(force: bool) {
    FORCE_HOST_SYNC.store(force, Ordering::SeqCst);
}

fn host_sync_forced() -> bool {
    // The environment is read once: this runs on every library call.
    static ENV: OnceLock<bool> = OnceLock::new();
    FORCE_HOST_SYNC.load(Ordering::SeqCst)
        || *ENV
            .get_or_init(|| std::env::var("BASTILE_MATMUL_ORDER").is_ok_and(|v| v == "host-sync"))
}

/// CubeCL's stream for the next call from this CubeCL stream on device
/// `index`, or `None` when the call is ordered by host synchronization.
pub(crate) fn same_stream(client: &ComputeClient<CudaRuntime>, index: usize) -> Option<CUstream> {
    if host_sync_forced() {
        return None;
    }
    let stream = stream_probe::cubecl_stream(client, index);
    // Not an error, but a user chasing speed wants to know why small
    // matmuls are slow.
    static TOLD: AtomicBool = AtomicBool::new(false);
    if stream.is_none() && !TOLD.swap(true, Ordering::SeqCst) {
        eprintln!(
            "bastile: CubeCL's CUDA stream could not be observed (CUPTI missing from the library \
             path, or held by a profiler); cuBLASLt and cuDNN calls are ordered by host \
             synchronization"
        );
    }
    stream
}

/// The mode the next call from this CubeCL stream on device `index` uses.
pub fn order_mode(client: &ComputeClient<CudaRuntime>, index: usize) -> OrderMode {
    match same_stream(client, index) {
        Some(_) => OrderMode::SameStream,
        None => OrderMode::HostSync,
    }
}

/// How one call is ordered against CubeCL's work.
#[derive(Clone, Copy)]
pub(crate) enum Order<'a> {
    /// Enqueued on CubeCL's own stream ([`same_stream`]'s answer), from
    /// CubeCL's device thread.
    Stream(CUstream),
    /// Between a synchronization of this client's stream and one of the
    /// library's own.
    HostSync(&'a ComputeClient<CudaRuntime>),
}

/// A call's way to its buffers: each binding's device address, the buffer
/// kept alive until the call is enqueued.
pub(crate) type Addresses<'a> = dyn FnMut(&Binding) -> Result<u64, KernelError> + 'a;

/// A buffer as a queued call holds it: alive until the call is enqueued,
/// without counting as an owner that keeps later ops from writing it in
/// place (see the module's doc).
pub(crate) fn as_queued(handle: &Handle) -> Binding {
    handle.clone().binding()
}

/// Hands `enqueue` (a library call on CUDA device `index`) the order it
/// runs in and its buffers' addresses: as a task of CubeCL's device thread
/// on CubeCL's stream, returning at once (an error met there goes to
/// `on_error`, on that thread), or here between host synchronizations
/// when that stream cannot be observed (an error is returned).
pub(crate) fn submit(
    client: &ComputeClient<CudaRuntime>,
    index: usize,
    enqueue: impl FnOnce(Order<'_>, &mut Addresses<'_>) -> Result<(), KernelError> + Send + 'static,
    on_error: impl FnOnce(KernelError) + Send + 'static,
) -> Result<(), KernelError> {
    let address_error =
        |e: &dyn std::fmt::Debug| KernelError::Launch(format!("buffer address: {e:?}"));
    let device =
        || DeviceHandle::<<CudaRuntime as Runtime>::Server>::new(CudaDevice { index }.to_id());
    let Some(stream) = same_stream(client, index) else {
        // Resolved here, on the caller's stream, as `get_resource` does
        // for a handle.
        let stream_id = StreamId::current();
        let mut held = Vec::new();
        let mut address = |b: &Binding| {
            let b = b.clone();
            let r = device()
                .submit_blocking(move |server| server.get_resource(b, stream_id))
                .map_err(|e| address_error(&e))?
                .map_err(|e| address_error(&e))?;
            let ptr = r.resource().ptr;
            held.push(r);
            Ok(ptr)
        };
        return enqueue(Order::HostSync(client), &mut address);
    };
    // The stream crosses to the device thread as an address (raw pointers
    // are not `Send`).
    let stream = stream as usize;
    device().submit(move |server| {
        // The device thread runs each task under the stream id it was
        // submitted from: the caller's CubeCL stream.
        let stream_id = StreamId::current();
        let mut held = Vec::new();
        let mut address = |b: &Binding| {
            let r = server
                .get_resource(b.clone(), stream_id)
                .map_err(|e| address_error(&e))?;
            let ptr = r.resource().ptr;
            held.push(r);
            Ok(ptr)
        };
        if let Err(e) = enqueue(Order::Stream(stream as CUstream), &mut address) {
            on_error(e);
        }
    });
    Ok(())
}

/// Runs `launch` (which enqueues on the stream it is given) ordered after
/// every CubeCL operation submitted so far and before every later one: on
/// CubeCL's stream, or on `own_stream` between host synchronizations. The
/// caller has already fetched the operands' resources.
pub(crate) fn ordered<S>(
    order: Order<'_>,
    state: &mut S,
    own_stream: CUstream,
    launch: impl FnOnce(&mut S, CUstream) -> Result<(), KernelError>,
) -> Result<(), KernelError> {
    let client = match order {
        Order::Stream(stream) => return launch(state, stream),
        Order::HostSync(client) => client,
    };
    cubecl::future::block_on(client.sync())
        .map_err(|e| KernelError::Launch(format!("waiting for CubeCL's stream: {e:?}")))?;
    let launched = launch(state, own_stream);
    // SAFETY: `own_stream` is a live stream of the current context.
    let synced = unsafe { drv::stream::synchronize(own_stream) }
        .map_err(|e| KernelError::Launch(format!("cuStreamSynchronize: {e:?}")));
    launched.and(synced)
}

/// The primary context of CUDA device `index` (the one CubeCL uses),
/// retained once more for the process's lifetime and made current on the
/// calling thread, and a non-blocking stream of the library's own in it.
pub(crate) fn context_and_stream(index: usize) -> Result<(CUcontext, CUstream), String> {
    drv::init().map_err(|e| format!("driver init: {e:?}"))?;
    let device = drv::device::get(index as i32).map_err(|e| format!("device: {e:?}"))?;
    // SAFETY: `device` is valid; the retained context is never released.
    let ctx = unsafe { drv::primary_ctx::retain(device) }.map_err(|e| format!("context: {e:?}"))?;
    make_current(ctx).map_err(|e| e.to_string())?;
    let stream = drv::stream::create(drv::stream::StreamKind::NonBlocking)
        .map_err(|e| format!("stream: {e:?}"))?;
    Ok((ctx, stream))
}

/// Makes `ctx` (from [`context_and_stream`]) current on the calling thread.
fn make_current(ctx: CUcontext) -> Result<(), KernelError> {
    // SAFETY: `ctx` is retained for the process's lifetime.
    unsafe { drv::ctx::set_current(ctx) }
        .map_err(|e| KernelError::Launch(format!("cuCtxSetCurrent: {e:?}")))
}

/// A library's state on one CUDA device, which holds the context (from
/// [`context_and_stream`]) its calls run in.
pub(crate) trait InContext {
    fn context(&self) -> CUcontext;
}

/// A library's state per CUDA device ordinal, created on first use; a
/// failed creation is kept, so the check is not repeated. Each device has
/// a lock of its own: data-parallel workers use their devices at once.
pub(crate) struct PerDevice<S> {
    slots: Mutex<Vec<Slot<S>>>,
}

type Slot<S> = Arc<Mutex<Option<Result<S, KernelError>>>>;

impl<S: InContext> PerDevice<S> {
    pub(crate) const fn new() -> Self {
        Self {
            slots: Mutex::new(Vec::new()),
        }
    }

    /// Runs `f` with device `index`'s state, created by `init` on first
    /// use, its context current on the calling thread.
    pub(crate) fn with<T>(
        &self,
        index: usize,
        init: impl FnOnce(usize) -> Result<S, KernelError>,
        f: impl FnOnce(&mut S) -> Result<T, KernelError>,
    ) -> Result<T, KernelError> {
        let slot = {
            let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
            if slots.len() <= index {
                slots.resize_with(index + 1, Slot::default);
            }
            slots[index].clone()
        };
        let mut slot = slot.lock().unwrap_or_else(|p| p.into_inner());
        match slot.get_or_insert_with(|| init(index)) {
            Ok(state) => {
                make_current(state.context())?;
                f(state)
            }
            Err(e) => Err(e.clone()),
        }
    }
}
