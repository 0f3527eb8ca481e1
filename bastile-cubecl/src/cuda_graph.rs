//! Recording the GPU work of one training step as CUDA graphs, and
//! replaying it: a few `cuGraphLaunch` calls instead of the host queueing
//! every kernel again (about 30 µs of host time a kernel through Burn and
//! CubeCL, against a few µs of GPU time for many of them).
//!
//! [`begin`] starts capturing CubeCL's CUDA stream (the one the caller's
//! CubeCL stream id maps to), from CubeCL's device thread, so that the
//! capture starts after every task queued before it; the caller then
//! queues the step as usual, and [`end`] (again a task of the device
//! thread, after the step's) closes the capture into a [`StepGraph`].
//! While capturing, nothing runs: the graphs hold the kernels, cuBLASLt's
//! calls and the uploads, with the buffers they had in that step.
//!
//! What CubeCL does in a step that would not replay as it was captured is
//! repaired or refused here:
//! - Kernel metadata (shapes and strides) is uploaded from pinned staging
//!   memory that CubeCL recycles once it believes the upload done. Each
//!   upload's bytes are copied when the upload is issued (a CUPTI callback
//!   on `cuMemcpyHtoDAsync_v2` and `cuMemcpy2DAsync_v2`), and the graphs'
//!   copies are pointed at those copies, in pinned memory the graphs own.
//! - CubeCL waits on a fence every 64 uploads, and waiting on an event
//!   recorded during a capture invalidates it: the capture is cut into
//!   segments around each such wait (see `on_driver_call`), replayed in
//!   order.
//! - A device allocation or free during the capture would be recorded
//!   into the graph (stream-ordered allocations are graph nodes) or free
//!   memory the graph uses: the capture fails with a descriptive error.
//!   Steps run before the capture bring CubeCL's pools to the size a step
//!   needs.
//! - Any other host synchronization inside the step invalidates the
//!   capture: CUDA reports it when the capture ends.
//!
//! What the caller guarantees: every buffer a step reads from outside it
//! (parameters, optimizer state, inputs) stays allocated while the graph
//! lives and is written in place, new inputs are copied into the captured
//! ones ([`copy`]) before each [`StepGraph::launch`], and nothing uploaded
//! inside the step changes from step to step (a replay repeats the
//! recorded bytes).

use std::ffi::c_void;
use std::sync::Mutex;

use cubecl::Runtime;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::device::Device;
use cubecl::device_handle::DeviceHandle;
use cubecl::prelude::ComputeClient;
use cubecl::server::{Binding, ComputeServer};
use cubecl::stream_id::StreamId;
use cudarc::cupti::sys as cupti;
use cudarc::driver::sys::{self as cu, CUcontext, CUgraph, CUgraphExec, CUgraphNode, CUresult};

use crate::KernelError;
use crate::cuda_stream;

/// What the CUPTI callback saw during the capture in progress.
struct Recording {
    /// The captured stream's address.
    stream: usize,
    /// Each upload to the device on that stream, in issue order.
    uploads: Vec<Upload>,
    /// The first call that makes the capture unusable.
    trouble: Option<String>,
    /// The graphs of the capture's earlier segments, in order (see
    /// [`on_driver_call`]), as addresses.
    segments: Vec<usize>,
    /// Between the end of a segment and the start of the next.
    paused: bool,
    /// CubeCL's device thread, the one that enqueues on the stream: only
    /// its waits cut the capture.
    thread: Option<std::thread::ThreadId>,
}

/// An upload as it was issued: its destination and its rows' bytes, as
/// they were then, one after the other.
struct Upload {
    dst: u64,
    row_bytes: usize,
    bytes: Vec<u8>,
}

/// The capture in progress (one at a time in a process: CUPTI takes one
/// subscriber).
static RECORDING: Mutex<Option<Recording>> = Mutex::new(None);
/// The CUPTI subscriber of the capture in progress, as an address.
static SUBSCRIBER: Mutex<Option<usize>> = Mutex::new(None);

fn record() -> std::sync::MutexGuard<'static, Option<Recording>> {
    RECORDING.lock().unwrap_or_else(|p| p.into_inner())
}

type Cbid = cupti::CUpti_driver_api_trace_cbid_enum;

/// The driver calls watched during a capture: the uploads, and the calls
/// that would leave the graph wrong (named in the error).
const WATCHED: [(Cbid, Option<&str>); 8] = [
    (Cbid::CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoDAsync_v2, None),
    (Cbid::CUPTI_DRIVER_TRACE_CBID_cuEventSynchronize, None),
    (
        Cbid::CUPTI_DRIVER_TRACE_CBID_cuMemAllocAsync,
        Some("a device allocation (cuMemAllocAsync)"),
    ),
    (
        Cbid::CUPTI_DRIVER_TRACE_CBID_cuMemFreeAsync,
        Some("a device free (cuMemFreeAsync)"),
    ),
    (
        Cbid::CUPTI_DRIVER_TRACE_CBID_cuMemAlloc_v2,
        Some("a device allocation (cuMemAlloc)"),
    ),
    (
        Cbid::CUPTI_DRIVER_TRACE_CBID_cuMemFree_v2,
        Some("a device free (cuMemFree)"),
    ),
    (Cbid::CUPTI_DRIVER_TRACE_CBID_cuMemcpy2DAsync_v2, None),
    (
        Cbid::CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoD_v2,
        Some("a blocking upload (cuMemcpyHtoD)"),
    ),
];

/// Records the uploads of the captured stream and the calls that would
/// leave the graph wrong.
///
/// CubeCL waits on a fence every 64 uploads (to recycle their staging
/// memory), and waiting on an event recorded during a capture ends the
/// capture as invalid. So the capture is cut there: before the wait, the
/// segment captured so far is closed into a graph of its own; after it, a
/// new segment starts. A replay launches the segments in order.
unsafe extern "C" fn on_driver_call(
    _userdata: *mut c_void,
    domain: cupti::CUpti_CallbackDomain,
    cbid: cupti::CUpti_CallbackId,
    cbdata: *const c_void,
) {
    if domain != cupti::CUpti_CallbackDomain::CUPTI_CB_DOMAIN_DRIVER_API || cbdata.is_null() {
        return;
    }
    // SAFETY: for driver-API callbacks CUPTI passes a `CUpti_CallbackData`.
    let data = unsafe { &*(cbdata as *const cupti::CUpti_CallbackData) };
    if data.functionParams.is_null() {
        return;
    }
    let entering = data.callbackSite == cupti::CUpti_ApiCallbackSite::CUPTI_API_ENTER;
    if cbid == Cbid::CUPTI_DRIVER_TRACE_CBID_cuEventSynchronize as u32 {
        cut_segment(entering);
        return;
    }
    if !entering {
        return;
    }
    let mut recording = record();
    let Some(rec) = recording.as_mut() else {
        return;
    };
    if cbid == Cbid::CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoDAsync_v2 as u32 {
        // SAFETY: the parameters of `cuMemcpyHtoDAsync_v2`, per the id.
        let p = unsafe { &*(data.functionParams as *const cupti::cuMemcpyHtoDAsync_v2_params_st) };
        if p.hStream as usize == rec.stream && p.ByteCount > 0 && !p.srcHost.is_null() {
            // SAFETY: the caller hands the driver `ByteCount` readable
            // bytes at `srcHost`, alive for the call.
            let bytes = unsafe { std::slice::from_raw_parts(p.srcHost as *const u8, p.ByteCount) };
            rec.uploads.push(Upload {
                dst: p.dstDevice,
                row_bytes: p.ByteCount,
                bytes: bytes.to_vec(),
            });
        }
        return;
    }
    if cbid == Cbid::CUPTI_DRIVER_TRACE_CBID_cuMemcpy2DAsync_v2 as u32 {
        // SAFETY: the parameters of `cuMemcpy2DAsync_v2`, per the id.
        let p = unsafe { &*(data.functionParams as *const cupti::cuMemcpy2DAsync_v2_params_st) };
        if p.hStream as usize == rec.stream && !p.pCopy.is_null() {
            // SAFETY: the copy's description, alive for the call.
            record_2d(rec, unsafe { &*p.pCopy });
        }
        return;
    }
    if let Some((_, Some(why))) = WATCHED.iter().find(|(id, _)| *id as u32 == cbid) {
        rec.trouble.get_or_insert_with(|| why.to_string());
    }
}

/// Records a strided copy of the captured stream: an upload's rows, one
/// after the other.
fn record_2d(rec: &mut Recording, c: &cu::CUDA_MEMCPY2D) {
    if c.srcMemoryType != cu::CUmemorytype::CU_MEMORYTYPE_HOST {
        return;
    }
    if c.dstMemoryType != cu::CUmemorytype::CU_MEMORYTYPE_DEVICE {
        rec.trouble
            .get_or_insert_with(|| "a strided copy into host memory".into());
        return;
    }
    let mut bytes = Vec::with_capacity(c.WidthInBytes * c.Height);
    for row in 0..c.Height {
        let at = c.srcXInBytes + (c.srcY + row) * c.srcPitch;
        // SAFETY: the caller hands the driver `Height` rows of
        // `WidthInBytes` readable bytes, `srcPitch` apart.
        let row =
            unsafe { std::slice::from_raw_parts((c.srcHost as *const u8).add(at), c.WidthInBytes) };
        bytes.extend_from_slice(row);
    }
    rec.uploads.push(Upload {
        dst: c.dstDevice + (c.dstXInBytes + c.dstY * c.dstPitch) as u64,
        row_bytes: c.WidthInBytes,
        bytes,
    });
}

/// Around a host wait on an event: closes the segment captured so far
/// before it (`entering`), starts the next one after it.
fn cut_segment(entering: bool) {
    let stream = match record().as_ref() {
        Some(rec) if rec.paused != entering && rec.thread == Some(std::thread::current().id()) => {
            rec.stream as cu::CUstream
        }
        _ => return,
    };
    // The driver calls are made without the lock: CUPTI does not call back
    // for them, and nothing else records while this thread waits here.
    let mut graph: CUgraph = std::ptr::null_mut();
    let (result, what) = if entering {
        // SAFETY: the stream `begin` started capturing.
        let ended = unsafe { cu::cuStreamEndCapture(stream, &mut graph) };
        (ended, "close")
    } else {
        // SAFETY: CubeCL's live stream, not capturing since the cut.
        (unsafe { start_capture(stream) }, "start")
    };
    let mut recording = record();
    let Some(rec) = recording.as_mut() else {
        return;
    };
    rec.paused = entering;
    if result != CUresult::CUDA_SUCCESS {
        rec.trouble
            .get_or_insert_with(|| format!("a capture segment that failed to {what}: {result:?}"));
    }
    if !graph.is_null() {
        rec.segments.push(graph as usize);
    }
}

/// Starts capturing `stream`. Relaxed mode lets CubeCL's other threads
/// make the calls a capture does not record (pinned host allocations),
/// which the callback watches.
///
/// # Safety
///
/// `stream` is a live stream of the current context, not capturing.
unsafe fn start_capture(stream: cu::CUstream) -> CUresult {
    // SAFETY: per the caller.
    unsafe {
        cu::cuStreamBeginCapture_v2(
            stream,
            cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        )
    }
}

fn check(what: &str, result: CUresult) -> Result<(), KernelError> {
    if result == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(KernelError::Launch(format!("{what}: {result:?}")))
    }
}

fn cupti_check(what: &str, result: cupti::CUptiResult) -> Result<(), KernelError> {
    if result == cupti::CUptiResult::CUPTI_SUCCESS {
        Ok(())
    } else {
        Err(KernelError::Launch(format!("{what}: {result:?}")))
    }
}

fn subscribe(stream: usize) -> Result<(), KernelError> {
    // SAFETY: only tries to open the library.
    if !unsafe { cupti::is_culib_present() } {
        return Err(KernelError::Launch(
            "CUPTI is not on the library path: a step graph needs it to keep its uploads".into(),
        ));
    }
    let mut subscriber: cupti::CUpti_SubscriberHandle = std::ptr::null_mut();
    // SAFETY: `on_driver_call` matches `CUpti_CallbackFunc`.
    cupti_check("cuptiSubscribe (a profiler may hold CUPTI)", unsafe {
        cupti::cuptiSubscribe(&mut subscriber, Some(on_driver_call), std::ptr::null_mut())
    })?;
    *record() = Some(Recording {
        stream,
        uploads: Vec::new(),
        trouble: None,
        segments: Vec::new(),
        paused: false,
        thread: None,
    });
    *SUBSCRIBER.lock().unwrap_or_else(|p| p.into_inner()) = Some(subscriber as usize);
    for (cbid, _) in WATCHED {
        // SAFETY: `subscriber` was just created.
        let enabled = unsafe {
            cupti::cuptiEnableCallback(
                1,
                subscriber,
                cupti::CUpti_CallbackDomain::CUPTI_CB_DOMAIN_DRIVER_API,
                cbid as u32,
            )
        };
        if let Err(e) = cupti_check("cuptiEnableCallback", enabled) {
            unsubscribe();
            return Err(e);
        }
    }
    Ok(())
}

/// Ends the CUPTI subscription; what it recorded.
fn unsubscribe() -> Option<Recording> {
    if let Some(s) = SUBSCRIBER.lock().unwrap_or_else(|p| p.into_inner()).take() {
        // SAFETY: the subscriber `subscribe` made.
        unsafe { cupti::cuptiUnsubscribe(s as cupti::CUpti_SubscriberHandle) };
    }
    record().take()
}

fn device_handle(index: usize) -> DeviceHandle<Server> {
    DeviceHandle::new(CudaDevice { index }.to_id())
}

/// CubeCL's stream for the caller's stream id, as an address.
fn stream_of(client: &ComputeClient<CudaRuntime>, index: usize) -> Result<usize, KernelError> {
    cuda_stream::same_stream(client, index)
        .map(|s| s as usize)
        .ok_or_else(|| {
            KernelError::Launch(
                "CubeCL's CUDA stream could not be observed (CUPTI missing or held by a profiler)"
                    .into(),
            )
        })
}

type Server = <CudaRuntime as Runtime>::Server;

/// Runs `task` on CubeCL's device thread for device `index`, after every
/// task queued before it, with the caller's stream id.
fn on_device_thread<T: Send>(
    index: usize,
    task: impl FnOnce(&mut Server) -> Result<T, KernelError> + Send,
) -> Result<T, KernelError> {
    device_handle(index)
        .submit_blocking(task)
        .map_err(|e| KernelError::Launch(format!("CubeCL's device thread: {e:?}")))?
}

/// The device address of `buffer`'s view, on the device thread (`server`)
/// for the caller's stream id.
fn buffer_address(server: &mut Server, buffer: Binding) -> Result<u64, KernelError> {
    server
        .get_resource(buffer, StreamId::current())
        .map(|r| r.resource().ptr)
        .map_err(|e| KernelError::Launch(format!("buffer address: {e:?}")))
}

/// Starts capturing the work the caller's CubeCL stream queues on CUDA
/// device `index` from here on; [`end`] closes the capture. Every buffer
/// the step allocates should already be in CubeCL's pools (run the step
/// once or twice before).
pub fn begin(client: &ComputeClient<CudaRuntime>, index: usize) -> Result<(), KernelError> {
    // Before anything waits on the stream: a wait on a capturing stream
    // would break the capture in progress.
    if record().is_some() {
        return Err(KernelError::Launch(
            "another step graph is being captured".into(),
        ));
    }
    let stream = stream_of(client, index)?;
    // The capture starts from a settled stream: CubeCL's pending uploads
    // and frees are done before it.
    cubecl::future::block_on(client.sync())
        .map_err(|e| KernelError::Launch(format!("waiting for CubeCL's stream: {e:?}")))?;
    subscribe(stream)?;
    let began = on_device_thread(index, move |_| {
        if let Some(rec) = record().as_mut() {
            rec.thread = Some(std::thread::current().id());
        }
        // SAFETY: CubeCL's live stream; no capture is in progress.
        check("cuStreamBeginCapture", unsafe {
            start_capture(stream as cu::CUstream)
        })
    });
    if began.is_err() {
        unsubscribe();
    }
    began
}

/// One step's GPU work, recorded by [`begin`] and [`end`], ready to replay:
/// the graphs of the capture's segments, launched in order.
pub struct StepGraph {
    graphs: Vec<CUgraph>,
    execs: Vec<CUgraphExec>,
    context: CUcontext,
    stream: usize,
    index: usize,
    /// The uploads' bytes, in pinned memory the graphs' copies read (null
    /// until made).
    uploads: *mut c_void,
    /// Kernel launches and copies in the graphs.
    pub kernels: usize,
    pub copies: usize,
}

// SAFETY: the handles are plain CUDA objects, used under the context
// stored with them; launches go through CubeCL's device thread.
unsafe impl Send for StepGraph {}
unsafe impl Sync for StepGraph {}

impl std::fmt::Debug for StepGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepGraph")
            .field("segments", &self.execs.len())
            .field("kernels", &self.kernels)
            .field("copies", &self.copies)
            .finish()
    }
}

/// A graph's nodes in order, for a graph captured from one stream (a
/// chain: each node has at most one dependent).
fn chain(graph: CUgraph) -> Result<Vec<CUgraphNode>, KernelError> {
    let mut count = 0usize;
    // SAFETY: counting the nodes of a live graph.
    check("cuGraphGetNodes", unsafe {
        cu::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut count)
    })?;
    if count == 0 {
        return Ok(Vec::new());
    }
    let mut roots = [std::ptr::null_mut(); 2];
    let mut root_count = roots.len();
    // SAFETY: `roots` holds `root_count` nodes.
    check("cuGraphGetRootNodes", unsafe {
        cu::cuGraphGetRootNodes(graph, roots.as_mut_ptr(), &mut root_count)
    })?;
    if root_count != 1 {
        return Err(KernelError::Launch(format!(
            "the captured step has {root_count} first operations, not one chain"
        )));
    }
    let mut nodes = Vec::with_capacity(count);
    let mut node = roots[0];
    loop {
        nodes.push(node);
        let mut next = [std::ptr::null_mut(); 2];
        // Edges may carry data (cuBLASLt's kernels let the next one start
        // early), which the query must have room for.
        let mut edges = [cu::CUgraphEdgeData {
            from_port: 0,
            to_port: 0,
            type_: 0,
            reserved: [0; 5],
        }; 2];
        let mut n = next.len();
        // SAFETY: `next` and `edges` hold `n` entries each.
        check("cuGraphNodeGetDependentNodes", unsafe {
            cu::cuGraphNodeGetDependentNodes_v2(node, next.as_mut_ptr(), edges.as_mut_ptr(), &mut n)
        })?;
        match n {
            0 => break,
            1 => node = next[0],
            _ => {
                return Err(KernelError::Launch(
                    "the captured step branches: it used more than one stream".into(),
                ));
            }
        }
    }
    if nodes.len() != count {
        return Err(KernelError::Launch(format!(
            "the captured step is not one chain ({} of {count} operations in order)",
            nodes.len()
        )));
    }
    Ok(nodes)
}

/// Points the graph's uploads at copies of their bytes in `arena`
/// (pinned, sized for all of them, each 16-byte aligned), rows one after
/// the other; the number of kernels and copies.
fn repoint_uploads(
    nodes: &[CUgraphNode],
    uploads: &[Upload],
    arena: *mut u8,
) -> Result<(usize, usize), KernelError> {
    let mut next = uploads.iter();
    let mut offset = 0usize;
    let (mut kernels, mut copies) = (0, 0);
    for &node in nodes {
        let mut kind = cu::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: a node of the live graph.
        check("cuGraphNodeGetType", unsafe {
            cu::cuGraphNodeGetType(node, &mut kind)
        })?;
        match kind {
            cu::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL => kernels += 1,
            cu::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMCPY => {
                copies += 1;
                let mut params = std::mem::MaybeUninit::<cu::CUDA_MEMCPY3D>::uninit();
                // SAFETY: a memcpy node; the driver fills every field.
                check("cuGraphMemcpyNodeGetParams", unsafe {
                    cu::cuGraphMemcpyNodeGetParams(node, params.as_mut_ptr())
                })?;
                // SAFETY: written by the call above.
                let mut params = unsafe { params.assume_init() };
                if params.srcMemoryType != cu::CUmemorytype::CU_MEMORYTYPE_HOST {
                    continue;
                }
                let Some(upload) = next.next() else {
                    return Err(KernelError::Launch(
                        "the captured step has an upload the callback did not see".into(),
                    ));
                };
                let dst =
                    params.dstDevice + (params.dstXInBytes + params.dstY * params.dstPitch) as u64;
                let rows = params.Height.max(1) * params.Depth.max(1);
                if dst != upload.dst
                    || params.WidthInBytes != upload.row_bytes
                    || params.WidthInBytes * rows != upload.bytes.len()
                {
                    return Err(KernelError::Launch(format!(
                        "the captured step's uploads are out of order: {rows} rows of {} bytes \
                         to {dst:#x}, {} bytes to {:#x} seen",
                        params.WidthInBytes,
                        upload.bytes.len(),
                        upload.dst
                    )));
                }
                // SAFETY: `arena` holds every upload, 16-byte aligned each.
                let at = unsafe { arena.add(offset) };
                unsafe {
                    std::ptr::copy_nonoverlapping(upload.bytes.as_ptr(), at, upload.bytes.len())
                };
                offset += upload.bytes.len().next_multiple_of(16);
                // The rows now lie one after the other.
                params.srcHost = at as *const c_void;
                (params.srcXInBytes, params.srcY, params.srcZ) = (0, 0, 0);
                params.srcPitch = params.WidthInBytes;
                params.srcHeight = params.Height.max(1);
                check("cuGraphMemcpyNodeSetParams", unsafe {
                    cu::cuGraphMemcpyNodeSetParams(node, &params)
                })?;
            }
            cu::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMSET
            | cu::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY => {}
            other => {
                return Err(KernelError::Launch(format!(
                    "the captured step holds an operation a replay cannot repeat: {other:?}"
                )));
            }
        }
    }
    if next.next().is_some() {
        return Err(KernelError::Launch(
            "the callback saw uploads the captured step does not hold".into(),
        ));
    }
    Ok((kernels, copies))
}

/// Closes the capture [`begin`] started: the step's work as graphs ready
/// to replay, or why it cannot be replayed.
pub fn end(client: &ComputeClient<CudaRuntime>, index: usize) -> Result<StepGraph, KernelError> {
    let stream = stream_of(client, index)?;
    let ended = on_device_thread(index, move |_| {
        let mut graph: CUgraph = std::ptr::null_mut();
        // SAFETY: the stream `begin` started capturing.
        let result = unsafe { cu::cuStreamEndCapture(stream as cu::CUstream, &mut graph) };
        let mut context: CUcontext = std::ptr::null_mut();
        // SAFETY: reading this thread's current context.
        check("cuCtxGetCurrent", unsafe {
            cu::cuCtxGetCurrent(&mut context)
        })?;
        Ok((result, graph as usize, context as usize))
    });
    let recording = unsubscribe();
    let (result, last, context) = ended?;
    let mut graphs: Vec<CUgraph> = recording
        .as_ref()
        .map(|r| r.segments.iter().map(|&g| g as CUgraph).collect())
        .unwrap_or_default();
    if last != 0 {
        graphs.push(last as CUgraph);
    }
    // From here on, dropping `step` releases whatever was made.
    let mut step = StepGraph {
        graphs,
        execs: Vec::new(),
        context: context as CUcontext,
        stream,
        index,
        uploads: std::ptr::null_mut(),
        kernels: 0,
        copies: 0,
    };
    let Some(recording) = recording else {
        return Err(KernelError::Launch("no capture was in progress".into()));
    };
    if let Some(why) = recording.trouble {
        return Err(KernelError::Launch(format!(
            "the captured step made {why}, which a replay would repeat or miss; run a step or \
             two before capturing, so that CubeCL's pools hold what a step needs"
        )));
    }
    check(
        "cuStreamEndCapture (a host synchronization inside the step invalidates a capture)",
        result,
    )?;
    let graphs: Vec<usize> = step.graphs.iter().map(|&g| g as usize).collect();
    let uploads = recording.uploads;
    // In the capturing thread's context, which the driver calls need.
    let prepared = on_device_thread(index, move |_| {
        let graphs: Vec<CUgraph> = graphs.into_iter().map(|g| g as CUgraph).collect();
        prepare(&graphs, &uploads)
    })?;
    step.uploads = prepared.uploads as *mut c_void;
    step.execs = prepared
        .execs
        .into_iter()
        .map(|e| e as CUgraphExec)
        .collect();
    (step.kernels, step.copies) = (prepared.kernels, prepared.copies);
    Ok(step)
}

/// What [`prepare`] makes of a capture's graphs, as addresses.
struct Prepared {
    uploads: usize,
    execs: Vec<usize>,
    kernels: usize,
    copies: usize,
}

/// Points the uploads of `graphs` at pinned copies of `uploads` and
/// instantiates the graphs that hold work; on an error, releases what it
/// made (the graphs stay the caller's).
fn prepare(graphs: &[CUgraph], uploads: &[Upload]) -> Result<Prepared, KernelError> {
    let mut nodes = Vec::new();
    let mut kept = Vec::new();
    for &graph in graphs {
        let chained = chain(graph)?;
        if !chained.is_empty() {
            kept.push(graph);
        }
        nodes.extend(chained);
    }
    let total: usize = uploads
        .iter()
        .map(|u| u.bytes.len().next_multiple_of(16))
        .sum();
    let mut arena: *mut c_void = std::ptr::null_mut();
    // SAFETY: a pinned allocation of `total` bytes (at least 16).
    check("cuMemAllocHost", unsafe {
        cu::cuMemAllocHost_v2(&mut arena, total.max(16))
    })?;
    let mut execs: Vec<usize> = Vec::with_capacity(kept.len());
    let made = repoint_uploads(&nodes, uploads, arena as *mut u8).and_then(|counts| {
        for &graph in &kept {
            let mut exec: CUgraphExec = std::ptr::null_mut();
            // SAFETY: a complete graph, instantiated where it was captured.
            check("cuGraphInstantiate", unsafe {
                cu::cuGraphInstantiateWithFlags(&mut exec, graph, 0)
            })?;
            execs.push(exec as usize);
        }
        Ok(counts)
    });
    match made {
        Ok((kernels, copies)) => Ok(Prepared {
            uploads: arena as usize,
            execs,
            kernels,
            copies,
        }),
        Err(e) => {
            // SAFETY: the executables and the arena made just above.
            unsafe {
                for exec in execs {
                    cu::cuGraphExecDestroy(exec as CUgraphExec);
                }
                cu::cuMemFreeHost(arena);
            }
            Err(e)
        }
    }
}

impl StepGraph {
    /// Queues the recorded step on CubeCL's stream, after everything
    /// queued before it; returns without waiting for it.
    pub fn launch(&self) -> Result<(), KernelError> {
        let execs: Vec<usize> = self.execs.iter().map(|&e| e as usize).collect();
        let stream = self.stream;
        on_device_thread(self.index, move |_| {
            for exec in execs {
                // SAFETY: a live executable graph and CubeCL's live stream.
                check("cuGraphLaunch", unsafe {
                    cu::cuGraphLaunch(exec as CUgraphExec, stream as cu::CUstream)
                })?;
            }
            Ok(())
        })
    }
}

impl Drop for StepGraph {
    fn drop(&mut self) {
        let execs: Vec<usize> = self.execs.drain(..).map(|e| e as usize).collect();
        let graphs: Vec<usize> = self.graphs.drain(..).map(|g| g as usize).collect();
        let (uploads, context, stream) =
            (self.uploads as usize, self.context as usize, self.stream);
        // On the device thread, after the last replay queued: the stream
        // orders nothing against a host free, so it is synchronized
        // before the pinned uploads are released.
        let _ = on_device_thread(self.index, move |_| {
            // SAFETY: CubeCL's live stream; then the objects `end` made,
            // each released once, in the context they were made in.
            unsafe {
                cu::cuCtxSetCurrent(context as CUcontext);
                cu::cuStreamSynchronize(stream as cu::CUstream);
                for exec in execs {
                    cu::cuGraphExecDestroy(exec as CUgraphExec);
                }
                for graph in graphs {
                    cu::cuGraphDestroy(graph as CUgraph);
                }
                if uploads != 0 {
                    cu::cuMemFreeHost(uploads as *mut c_void);
                }
            }
            Ok(())
        });
    }
}

/// Copies `bytes` bytes from `src` into `dst` on CubeCL's stream for the
/// caller's stream id on device `index`, after every operation queued
/// before: how a replayed step receives new inputs in the buffers it was
/// captured with.
pub fn copy(
    client: &ComputeClient<CudaRuntime>,
    index: usize,
    src: &Binding,
    dst: &Binding,
    bytes: usize,
) -> Result<(), KernelError> {
    let stream = stream_of(client, index)?;
    let (src, dst) = (src.clone(), dst.clone());
    on_device_thread(index, move |server| {
        let (from, to) = (buffer_address(server, src)?, buffer_address(server, dst)?);
        // SAFETY: both buffers hold `bytes` (the caller's check) and
        // stay alive until the copy ran: CubeCL frees in stream order.
        check("cuMemcpyDtoDAsync", unsafe {
            cu::cuMemcpyDtoDAsync_v2(to, from, bytes, stream as cu::CUstream)
        })
    })
}

/// The device addresses of `buffers` (each view's start), read in one task
/// of CubeCL's device thread for device `index`.
pub fn addresses(index: usize, buffers: Vec<Binding>) -> Result<Vec<u64>, KernelError> {
    on_device_thread(index, move |server| {
        buffers
            .into_iter()
            .map(|b| buffer_address(server, b))
            .collect()
    })
}
