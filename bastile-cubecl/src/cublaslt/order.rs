//! Ordering cuBLASLt's work against CubeCL's stream.
//!
//! CubeCL does not expose its CUDA stream, so the call runs on a stream of
//! ours between two synchronizations: CubeCL's stream is drained first
//! (the operands are written), and ours is drained before returning (any
//! later CubeCL kernel, including one that reuses a freed operand's
//! memory, starts after the matmul).

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::ComputeClient;
use cudarc::driver::result as drv;
use cudarc::driver::sys::CUstream;

use super::device::DeviceState;
use crate::KernelError;

/// How the calls are ordered against CubeCL's work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OrderMode {
    /// Host synchronization before and after, on cuBLASLt's own stream.
    HostSync,
}

/// The mode in use.
pub fn order_mode() -> OrderMode {
    OrderMode::HostSync
}

/// Runs `launch` (which enqueues on the given stream) ordered after every
/// CubeCL operation submitted so far and before every later one.
pub fn ordered(
    client: &ComputeClient<CudaRuntime>,
    dev: &DeviceState,
    launch: impl FnOnce(CUstream) -> Result<(), KernelError>,
) -> Result<(), KernelError> {
    cubecl::future::block_on(client.sync())
        .map_err(|e| KernelError::Launch(format!("waiting for CubeCL's stream: {e:?}")))?;
    let launched = launch(dev.stream);
    // SAFETY: `dev.stream` is a live stream of the current context.
    let synced = unsafe { drv::stream::synchronize(dev.stream) }
        .map_err(|e| KernelError::Launch(format!("cuStreamSynchronize: {e:?}")));
    launched.and(synced)
}
