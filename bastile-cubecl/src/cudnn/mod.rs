//! cuDNN's graph API on CubeCL's CUDA buffers, loaded at run time like the
//! rest of CUDA (`libcudnn.so.9`).
//!
//! A graph of cuDNN operations over tensors named by ids (`Graph`) is
//! finalized into an execution plan (`Plan`): cuDNN's heuristic lists
//! the engines that run the whole graph as one fused computation, and the
//! first that builds is kept. A plan runs on the buffers a call names by
//! the same ids. Its errors at build time are
//! [`KernelError::Unsupported`] (the caller takes another path); the
//! library, its handle and a stream of its own are kept per device.

mod graph;

use cudarc::cudnn::sys::{self as dnn, cudnnHandle_t, cudnnStatus_t};
use cudarc::driver::sys::{CUcontext, CUstream};

pub(crate) use graph::{Graph, Layout, Plan, SCALAR, Scalar, Storage, Uid};

use crate::KernelError;
use crate::cuda_stream::{InContext, PerDevice};

/// What cuDNN needs per CUDA device: CubeCL's context, the library handle
/// and a stream of our own (for calls ordered by host synchronization).
pub(crate) struct DeviceState {
    pub ctx: CUcontext,
    pub handle: cudnnHandle_t,
    pub stream: CUstream,
}

// SAFETY: the raw handles are used only while the device's lock is held,
// from whichever thread holds it; cuDNN handles and CUDA streams may be
// used from any thread of the process.
unsafe impl Send for DeviceState {}

/// The oldest cuDNN whose fused attention engines these graphs target.
const MIN_VERSION: usize = 9_00_00;

impl DeviceState {
    fn new(index: usize) -> Result<Self, KernelError> {
        let err =
            |what: &str| KernelError::Unsupported(format!("cuDNN on CUDA device {index}: {what}"));
        let Some(version) = version() else {
            return Err(err(
                "libcudnn was not found (add cuDNN 9's libraries to LD_LIBRARY_PATH)",
            ));
        };
        if version < MIN_VERSION {
            return Err(err(&format!("version {version} is older than 9.0")));
        }
        let (ctx, stream) = crate::cuda_stream::context_and_stream(index).map_err(|e| err(&e))?;
        let mut handle = std::ptr::null_mut();
        // SAFETY: the device's context is current (above).
        status(unsafe { dnn::cudnnCreate(&mut handle) })
            .map_err(|e| err(&format!("handle: {e}")))?;
        Ok(Self {
            ctx,
            handle,
            stream,
        })
    }
}

impl InContext for DeviceState {
    fn context(&self) -> CUcontext {
        self.ctx
    }
}

static DEVICES: PerDevice<DeviceState> = PerDevice::new();

/// Runs `f` with device `index`'s cuDNN state (its context current),
/// creating it on first use.
pub(crate) fn with_device<T>(
    index: usize,
    f: impl FnOnce(&mut DeviceState) -> Result<T, KernelError>,
) -> Result<T, KernelError> {
    DEVICES.with(index, DeviceState::new, f)
}

/// Whether cuDNN 9 can be used on CUDA device `index` (the library loads
/// and a handle is created there); the answer is cached.
pub fn available(index: usize) -> bool {
    with_device(index, |_| Ok(())).is_ok()
}

/// The loaded cuDNN's version (`major·10000 + minor·100 + patch`), if the
/// library is found.
pub fn version() -> Option<usize> {
    // SAFETY: `is_culib_present` only tries to open the library; the
    // version call reads a number.
    unsafe { dnn::is_culib_present().then(|| dnn::cudnnGetVersion()) }
}

/// `Ok` for `CUDNN_STATUS_SUCCESS`, else the status and cuDNN's words for
/// it.
fn status(s: cudnnStatus_t) -> Result<(), String> {
    if s == cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        return Ok(());
    }
    // SAFETY: cuDNN returns a static NUL-terminated string for any status.
    let words = unsafe { std::ffi::CStr::from_ptr(dnn::cudnnGetErrorString(s)) };
    Err(format!("{s:?} ({})", words.to_string_lossy()))
}
