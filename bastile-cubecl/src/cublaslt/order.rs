//! Ordering cuBLASLt's work against CubeCL's stream.
//!
//! Preferred: the matmul is enqueued on the very CUDA stream CubeCL uses for
//! the caller's stream id ([`stream_probe`]), from CubeCL's device thread as
//! one of its tasks, so CUDA orders it after every kernel CubeCL issued
//! before (the tasks queued before it) and before every later one,
//! including one that reuses a freed operand's memory (the task holds the
//! operands until the call is enqueued); the host never waits.
//!
//! Fallback, when that stream cannot be observed (CUPTI missing or held by
//! a profiler) or `BASTILE_MATMUL_ORDER=host-sync` is set: the call runs on a
//! stream of ours between two host synchronizations.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::ComputeClient;
use cudarc::driver::result as drv;
use cudarc::driver::sys::CUstream;

use super::device::DeviceState;
use super::stream_probe;
use crate::KernelError;

/// How a call is ordered against CubeCL's work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OrderMode {
    /// Enqueued on CubeCL's own stream.
    SameStream,
    /// Host synchronization before and after, on cuBLASLt's own stream.
    HostSync,
}

static FORCE_HOST_SYNC: AtomicBool = AtomicBool::new(false);

/// Forces [`OrderMode::HostSync`] (for comparison and debugging); the
/// environment variable `BASTILE_MATMUL_ORDER=host-sync` does the same.
pub fn force_host_sync(force: bool) {
    FORCE_HOST_SYNC.store(force, Ordering::SeqCst);
}

fn host_sync_forced() -> bool {
    // The environment is read once: this runs on every matmul.
    static ENV: OnceLock<bool> = OnceLock::new();
    FORCE_HOST_SYNC.load(Ordering::SeqCst)
        || *ENV
            .get_or_init(|| std::env::var("BASTILE_MATMUL_ORDER").is_ok_and(|v| v == "host-sync"))
}

/// CubeCL's stream for the next call from this CubeCL stream on device
/// `index`, or `None` when the call is ordered by host synchronization.
pub(super) fn same_stream(client: &ComputeClient<CudaRuntime>, index: usize) -> Option<CUstream> {
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
             path, or held by a profiler); cuBLASLt matmuls are ordered by host synchronization"
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
pub(super) enum Order<'a> {
    /// Enqueued on CubeCL's own stream ([`same_stream`]'s answer), from
    /// CubeCL's device thread.
    Stream(CUstream),
    /// Between a synchronization of this client's stream and one of
    /// cuBLASLt's own.
    HostSync(&'a ComputeClient<CudaRuntime>),
}

/// Runs `launch` (which enqueues on the stream and workspace it is given)
/// ordered after every CubeCL operation submitted so far and before every
/// later one; the caller has already fetched the operands' resources.
pub(super) fn ordered(
    order: Order<'_>,
    dev: &mut DeviceState,
    launch: impl FnOnce(&mut DeviceState, CUstream, u64) -> Result<(), KernelError>,
) -> Result<(), KernelError> {
    let client = match order {
        Order::Stream(stream) => {
            let workspace = dev.workspace_for(stream)?;
            return launch(dev, stream, workspace);
        }
        Order::HostSync(client) => client,
    };
    cubecl::future::block_on(client.sync())
        .map_err(|e| KernelError::Launch(format!("waiting for CubeCL's stream: {e:?}")))?;
    let (stream, workspace) = (dev.stream, dev.workspace_for(dev.stream)?);
    let launched = launch(dev, stream, workspace);
    // SAFETY: `stream` is a live stream of the current context.
    let synced = unsafe { drv::stream::synchronize(stream) }
        .map_err(|e| KernelError::Launch(format!("cuStreamSynchronize: {e:?}")));
    launched.and(synced)
}
