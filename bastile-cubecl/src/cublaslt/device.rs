//! What cuBLASLt needs per CUDA device, created on first use and kept for
//! the process: the library handle, a stream of our own, one workspace per
//! stream the calls are enqueued on (calls on different streams may run at
//! once) and each problem's descriptors and algorithm.

use std::collections::HashMap;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys::cublasLtHandle_t;
use cudarc::driver::result as drv;
use cudarc::driver::sys::{CUcontext, CUdeviceptr, CUstream};

use super::algo::{AlgoKey, Prepared};
use crate::KernelError;
use crate::cuda_stream::{InContext, PerDevice};

/// 32 MiB: what NVIDIA recommends for Hopper's cuBLASLt kernels.
pub const WORKSPACE_BYTES: usize = 32 << 20;

pub struct DeviceState {
    pub ctx: CUcontext,
    pub handle: cublasLtHandle_t,
    pub stream: CUstream,
    /// Keyed by the stream (as an address) whose calls use it.
    workspaces: HashMap<usize, CUdeviceptr>,
    /// `None`: the heuristic found no algorithm for this problem.
    pub prepared: HashMap<AlgoKey, Option<Prepared>>,
}

// SAFETY: the raw CUDA handles are only used while the device's lock is
// held, from whichever thread holds it; cuBLASLt handles and CUDA streams
// may be used from any thread of the process.
unsafe impl Send for DeviceState {}

impl DeviceState {
    fn new(index: usize) -> Result<Self, KernelError> {
        let err = |what: &str, e: &dyn std::fmt::Debug| {
            KernelError::Unsupported(format!("cuBLASLt on CUDA device {index}: {what}: {e:?}"))
        };
        // SAFETY: `is_culib_present` only tries to open the library.
        if !unsafe { cudarc::cublaslt::sys::is_culib_present() } {
            return Err(KernelError::Unsupported(
                "libcublasLt was not found (add the CUDA libraries to LD_LIBRARY_PATH)".into(),
            ));
        }
        let (ctx, stream) =
            crate::cuda_stream::context_and_stream(index).map_err(|e| err("CUDA", &e))?;
        let handle = lt::create_handle().map_err(|e| err("handle", &e))?;
        Ok(Self {
            ctx,
            handle,
            stream,
            workspaces: HashMap::new(),
            prepared: HashMap::new(),
        })
    }

    /// The workspace of calls enqueued on `stream`, allocated on first use.
    pub fn workspace_for(&mut self, stream: CUstream) -> Result<CUdeviceptr, KernelError> {
        if let Some(&w) = self.workspaces.get(&(stream as usize)) {
            return Ok(w);
        }
        // SAFETY: a plain device allocation in the current context, kept for
        // the process's lifetime (streams are never destroyed either).
        let w = unsafe { drv::malloc_sync(WORKSPACE_BYTES) }.map_err(|e| {
            KernelError::Launch(format!(
                "cuBLASLt workspace ({WORKSPACE_BYTES} bytes): {e:?}"
            ))
        })?;
        self.workspaces.insert(stream as usize, w);
        Ok(w)
    }
}

impl InContext for DeviceState {
    fn context(&self) -> CUcontext {
        self.ctx
    }
}

/// Per device ordinal, created on first use.
static DEVICES: PerDevice<DeviceState> = PerDevice::new();

/// Runs `f` with the device's state (its context current), creating it on
/// first use.
pub fn with_device<T>(
    index: usize,
    f: impl FnOnce(&mut DeviceState) -> Result<T, KernelError>,
) -> Result<T, KernelError> {
    DEVICES.with(index, DeviceState::new, f)
}
