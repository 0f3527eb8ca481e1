//! Finding the CUDA stream CubeCL launches on, so cuBLASLt and cuDNN can
//! enqueue their work on that same stream (ordered by CUDA itself, with no
//! host wait).
//!
//! CubeCL 0.10 keeps its `CUstream` private. The stream is observed instead:
//! a CUPTI callback on `cuLaunchKernel` is armed, a one-thread kernel of
//! ours is launched through the client from the calling CubeCL stream, and
//! the callback reads the launch's `hStream` (recognised by the kernel's
//! name). The answer is kept per (device, CubeCL stream id): CubeCL maps a
//! stream id to the same CUDA stream for the whole process. When CUPTI is
//! missing or refuses (another profiler is attached), the probe reports
//! `None` and the caller orders by host synchronization instead.

use std::collections::HashMap;
use std::ffi::{CStr, c_void};
use std::sync::Mutex;
use std::sync::atomic::{AtomicPtr, Ordering};

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cubecl::stream_id::StreamId;
use cudarc::cupti::sys as cupti;
use cudarc::driver::sys::CUstream;

/// The probe kernel's name: what the callback looks for in `symbolName`.
const PROBE_NAME: &[u8] = b"bastile_stream_probe";

#[cube(launch_unchecked)]
fn bastile_stream_probe(out: &mut Tensor<u32>) {
    if ABSOLUTE_POS == 0 {
        out[0] = 1;
    }
}

/// (device, CubeCL stream id) → the CUDA stream's address; `None` records
/// a failed probe, so it is not retried.
type StreamTable = HashMap<(usize, u64), Option<usize>>;

static STREAMS: Mutex<Option<StreamTable>> = Mutex::new(None);
/// One probe at a time: the callback writes the stream it saw here (null:
/// none seen yet).
static PROBING: Mutex<()> = Mutex::new(());
static SEEN_STREAM: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

/// The CUDA stream CubeCL uses for the calling code's current stream id on
/// device `index`, or `None` when it cannot be observed.
pub fn cubecl_stream(client: &ComputeClient<CudaRuntime>, index: usize) -> Option<CUstream> {
    let key = (index, StreamId::current().value);
    let mut streams = STREAMS.lock().unwrap_or_else(|p| p.into_inner());
    let known = streams.get_or_insert_with(HashMap::new);
    let stream = *known.entry(key).or_insert_with(|| probe(client));
    stream.map(|s| s as CUstream)
}

unsafe extern "C" fn on_launch(
    _userdata: *mut c_void,
    domain: cupti::CUpti_CallbackDomain,
    cbid: cupti::CUpti_CallbackId,
    cbdata: *const c_void,
) {
    if domain != cupti::CUpti_CallbackDomain::CUPTI_CB_DOMAIN_DRIVER_API
        || cbid
            != cupti::CUpti_driver_api_trace_cbid_enum::CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel
                as u32
        || cbdata.is_null()
    {
        return;
    }
    // SAFETY: for driver-API callbacks CUPTI passes a `CUpti_CallbackData`
    // whose `functionParams` are the called function's parameter struct.
    let data = unsafe { &*(cbdata as *const cupti::CUpti_CallbackData) };
    if data.callbackSite != cupti::CUpti_ApiCallbackSite::CUPTI_API_ENTER
        || data.symbolName.is_null()
        || data.functionParams.is_null()
    {
        return;
    }
    // SAFETY: a NUL-terminated name owned by CUPTI for the callback's span.
    let name = unsafe { CStr::from_ptr(data.symbolName) }.to_bytes();
    if !name.windows(PROBE_NAME.len()).any(|w| w == PROBE_NAME) {
        return;
    }
    // SAFETY: the parameters of `cuLaunchKernel`, per the callback id.
    let params = unsafe { &*(data.functionParams as *const cupti::cuLaunchKernel_params_st) };
    SEEN_STREAM.store(params.hStream as *mut c_void, Ordering::SeqCst);
}

fn probe(client: &ComputeClient<CudaRuntime>) -> Option<usize> {
    // SAFETY: only tries to open the library.
    if !unsafe { cupti::is_culib_present() } {
        return None;
    }
    let _only = PROBING.lock().unwrap_or_else(|p| p.into_inner());
    SEEN_STREAM.store(std::ptr::null_mut(), Ordering::SeqCst);
    let mut subscriber: cupti::CUpti_SubscriberHandle = std::ptr::null_mut();
    // SAFETY: `on_launch` matches `CUpti_CallbackFunc` and ignores userdata.
    let subscribed =
        unsafe { cupti::cuptiSubscribe(&mut subscriber, Some(on_launch), std::ptr::null_mut()) };
    if subscribed != cupti::CUptiResult::CUPTI_SUCCESS {
        return None;
    }
    // SAFETY: `subscriber` was just created.
    let enabled = unsafe {
        cupti::cuptiEnableCallback(
            1,
            subscriber,
            cupti::CUpti_CallbackDomain::CUPTI_CB_DOMAIN_DRIVER_API,
            cupti::CUpti_driver_api_trace_cbid_enum::CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel as u32,
        )
    };
    let observed = enabled == cupti::CUptiResult::CUPTI_SUCCESS && launch_probe(client);
    // SAFETY: unsubscribing the subscriber made above; later launches run
    // without callbacks.
    unsafe { cupti::cuptiUnsubscribe(subscriber) };
    let stream = SEEN_STREAM.load(Ordering::SeqCst) as usize;
    // Null: no launch seen, or one on the legacy default stream (CubeCL
    // creates its own streams, so that would not be CubeCL's): not observed.
    (observed && stream != 0).then_some(stream)
}

/// Launches the probe kernel on the current CubeCL stream and waits until
/// CubeCL has issued it.
fn launch_probe(client: &ComputeClient<CudaRuntime>) -> bool {
    let out = client.empty(4);
    // SAFETY: one u32 written by one unit into a 4-byte buffer.
    unsafe {
        bastile_stream_probe::launch_unchecked::<CudaRuntime>(
            client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(1),
            TensorArg::from_raw_parts(out, [1].into(), [1].into()),
        )
    };
    cubecl::future::block_on(client.sync()).is_ok()
}
