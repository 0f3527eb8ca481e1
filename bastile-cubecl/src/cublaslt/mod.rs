//! Matmuls through cuBLASLt on CubeCL's CUDA buffers.
//!
//! The operands are CubeCL handles; their device addresses come from
//! CubeCL's server (`get_resource`), which also keeps the memory alive
//! while the call is enqueued. A call on CubeCL's own stream runs as a
//! task of CubeCL's device thread, queued without waiting. The library, a
//! workspace and each problem's descriptors and algorithm are kept per
//! device (`device`); for short products the algorithm is the fastest of
//! the heuristic's candidates on the problem's first call (`tune`).
//! `crate::cuda_stream` enqueues the calls on CubeCL's own stream when it
//! can observe it, else orders them by host synchronization.

mod algo;
mod device;
mod tune;

use std::collections::hash_map::Entry;
use std::sync::atomic::{AtomicBool, Ordering};

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::ComputeClient;
use cubecl::server::{Binding, Handle};
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys::cublasLtMatmulAlgo_t;

use self::algo::{AlgoKey, Prepared};
use self::device::DeviceState;
use crate::cuda_stream::{self, Addresses, Order};
use crate::gemm_layout::GemmPlan;
use crate::{FloatDtype, KernelError};

pub use crate::cuda_stream::{OrderMode, force_host_sync, order_mode};

static TF32: AtomicBool = AtomicBool::new(false);

/// Lets f32 matmuls use TF32 tensor cores (10-bit mantissa products);
/// off by default, so f32 stays f32.
pub fn set_tf32(allow: bool) {
    TF32.store(allow, Ordering::SeqCst);
}

/// Whether f32 matmuls may use TF32.
pub fn tf32() -> bool {
    TF32.load(Ordering::SeqCst)
}

/// Whether cuBLASLt can be used on CUDA device `index` (the library loads
/// and the device initializes); the answer is cached.
pub fn available(index: usize) -> bool {
    device::with_device(index, |_| Ok(())).is_ok()
}

/// The buffers of one matmul: `out = scale · lhs · rhs (+ bias)`, laid out
/// as `plan` says; `bias` has one value per output column, for every
/// matrix of the batch or one vector per matrix (`bias_batch_stride`).
pub struct GemmBuffers<'a> {
    pub lhs: &'a Handle,
    pub rhs: &'a Handle,
    pub bias: Option<&'a Handle>,
    /// Elements between the bias vectors of consecutive matrices of the
    /// strided batch (a batch of linear layers, e.g. a mixture's experts);
    /// 0: one vector serves every matrix.
    pub bias_batch_stride: usize,
    /// The epilogue writes into `bias` the column sums of each matrix of
    /// `rhs` instead of adding it: in `dW = xᵀ · dy`, the gradient of the
    /// bias of the layer whose output gradient `dy` is, from the same pass
    /// over `dy`.
    pub bias_grad: bool,
    pub out: &'a Handle,
    /// The product's factor (α): applied in the epilogue, in f32, so a
    /// scaled product costs what a plain one does.
    pub scale: f32,
    /// `out += scale · lhs · rhs` (β = 1: the sum happens in the
    /// product's epilogue, reading `out` once) instead of overwriting
    /// `out`.
    pub accumulate: bool,
}

/// The dtypes of one matmul: `lhs`, `rhs` and `bias` are `operands`; `out`
/// is `operands` or f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmDtypes {
    pub operands: FloatDtype,
    pub out: FloatDtype,
}

/// Runs `plan` on CUDA device `index` with cuBLASLt. `Err(Unsupported)`
/// when cuBLASLt has no algorithm for it (nothing was written: the caller
/// can take another path).
///
/// On CubeCL's own stream the call is handed to CubeCL's device thread and
/// this returns at once: that thread runs it in its queue's order, after
/// every operation submitted before it, so the caller (Burn's fusion
/// thread, queuing a step) never waits for the device thread to drain its
/// queue. An error met there goes to `on_error`, on that thread. Ordered
/// by host synchronization, the call runs here and an error is returned.
pub fn gemm(
    client: &ComputeClient<CudaRuntime>,
    index: usize,
    dtypes: GemmDtypes,
    plan: &GemmPlan,
    buffers: GemmBuffers<'_>,
    on_error: impl FnOnce(KernelError) + Send + 'static,
) -> Result<(), KernelError> {
    if dtypes.out != dtypes.operands && (dtypes.out != FloatDtype::F32 || buffers.bias.is_some()) {
        return Err(KernelError::Unsupported(format!(
            "cuBLASLt path: {dtypes:?} (a different output dtype must be f32, without bias)"
        )));
    }
    if buffers.bias_grad && buffers.bias.is_none() {
        return Err(KernelError::Unsupported(
            "cuBLASLt path: a bias gradient without its buffer".into(),
        ));
    }
    if buffers.accumulate && buffers.bias.is_some() {
        return Err(KernelError::Unsupported(
            "cuBLASLt path: accumulating with a bias".into(),
        ));
    }
    // One call's epilogue steps through the batch's bias vectors; calls
    // beyond the first would need their own offsets into them.
    if bias_batch_stride(plan, &buffers) > 0 && plan.calls.len() > 1 {
        return Err(KernelError::Unsupported(format!(
            "cuBLASLt path: a bias per matrix over {} calls",
            plan.calls.len()
        )));
    }
    if plan.m == 0 || plan.n == 0 || plan.calls.is_empty() {
        return Ok(());
    }
    if plan.k == 0 {
        return Err(KernelError::Unsupported("matmul with K = 0".into()));
    }
    let call = Call::new(dtypes, plan, &buffers);
    // Whether cuBLASLt takes the problem is settled here, where the caller
    // can still take another path. The buffers' addresses are known only
    // where the call is enqueued (on the device thread), but their
    // alignment (up to the 256 bytes the key distinguishes) is their
    // offsets' within CubeCL's allocations, which start on 512-byte
    // boundaries.
    let expected = call.key([
        call.lhs.offset_start.unwrap_or(0),
        call.rhs.offset_start.unwrap_or(0),
        call.out.offset_start.unwrap_or(0),
        call.bias
            .as_ref()
            .map_or(0, |b| b.offset_start.unwrap_or(0)),
    ]);
    device::with_device(index, |dev| prepared(dev, expected).map(|_| ()))?;
    cuda_stream::submit(
        client,
        index,
        move |order, address| launch(index, order, &call, address),
        on_error,
    )
}

/// The bias epilogue's stride between matrices: 0 without a bias, a
/// batch or a per-matrix bias.
fn bias_batch_stride(plan: &GemmPlan, buffers: &GemmBuffers<'_>) -> usize {
    if buffers.bias.is_some() && plan.batch > 1 {
        buffers.bias_batch_stride
    } else {
        0
    }
}

/// The prepared algorithms of `key`, prepared on first use;
/// `Err(Unsupported)` when the heuristic has none.
fn prepared(dev: &mut DeviceState, key: AlgoKey) -> Result<&mut Prepared, KernelError> {
    let handle = dev.handle;
    let slot = match dev.prepared.entry(key) {
        Entry::Occupied(e) => e.into_mut(),
        Entry::Vacant(e) => e.insert(Prepared::new(&key, handle)?),
    };
    slot.as_mut()
        .ok_or_else(|| KernelError::Unsupported(format!("cuBLASLt has no algorithm for {key:?}")))
}

/// One matmul with its buffers, owned so it can cross to CubeCL's device
/// thread.
struct Call {
    dtypes: GemmDtypes,
    plan: GemmPlan,
    lhs: Binding,
    rhs: Binding,
    bias: Option<Binding>,
    /// [`bias_batch_stride`]'s answer.
    bias_batch_stride: usize,
    bias_grad: bool,
    out: Binding,
    scale: f32,
    accumulate: bool,
}

impl Call {
    fn new(dtypes: GemmDtypes, plan: &GemmPlan, buffers: &GemmBuffers<'_>) -> Self {
        Self {
            dtypes,
            plan: plan.clone(),
            lhs: cuda_stream::as_queued(buffers.lhs),
            rhs: cuda_stream::as_queued(buffers.rhs),
            bias: buffers.bias.map(cuda_stream::as_queued),
            bias_batch_stride: bias_batch_stride(plan, buffers),
            bias_grad: buffers.bias_grad,
            out: cuda_stream::as_queued(buffers.out),
            scale: buffers.scale,
            accumulate: buffers.accumulate,
        }
    }

    /// Bytes of an operand's element and of an output's.
    fn element_bytes(&self) -> (u64, u64) {
        (
            self.dtypes.operands.size() as u64,
            self.dtypes.out.size() as u64,
        )
    }

    /// The algorithm key of the call with its buffers at `addresses`
    /// (`[lhs, rhs, out, bias]`; the bias's is ignored without one): the
    /// alignment every matrix of every call shares enters the key.
    fn key(&self, [lhs, rhs, out, bias]: [u64; 4]) -> AlgoKey {
        let plan = &self.plan;
        let (elem, out_elem) = self.element_bytes();
        let align_of = |base: u64, slot: usize, batch_stride: usize, elem: u64| {
            plan.calls
                .iter()
                .map(|c| algo::alignment(base + c[slot] as u64 * elem))
                .chain((plan.batch > 1).then(|| algo::alignment(batch_stride as u64 * elem)))
                .min()
                .unwrap_or(256)
        };
        let align = [
            align_of(rhs, 1, plan.a.batch_stride, elem),
            align_of(lhs, 0, plan.b.batch_stride, elem),
            align_of(out, 2, plan.d_batch_stride, out_elem),
            self.bias.as_ref().map_or(256, |_| {
                let stride =
                    (self.bias_batch_stride > 0).then(|| self.bias_batch_stride as u64 * elem);
                algo::alignment(bias).min(stride.map_or(256, algo::alignment))
            }),
        ];
        let epilogue_bias = self.bias.as_ref().map(|_| algo::Bias {
            batch_stride: self.bias_batch_stride,
            grad: self.bias_grad,
        });
        algo::key(
            plan,
            [self.dtypes.operands, self.dtypes.out],
            tf32(),
            epilogue_bias,
            align,
        )
    }
}

/// [`gemm`]'s work once the ordering is known; `address` gives a
/// buffer's device address (and keeps it alive until the call is
/// enqueued).
fn launch(
    index: usize,
    order: Order<'_>,
    call: &Call,
    address: &mut Addresses<'_>,
) -> Result<(), KernelError> {
    let lhs_ptr = address(&call.lhs)?;
    let rhs_ptr = address(&call.rhs)?;
    let out_ptr = address(&call.out)?;
    let bias_ptr = call.bias.as_ref().map(&mut *address).transpose()?;
    let key = call.key([lhs_ptr, rhs_ptr, out_ptr, bias_ptr.unwrap_or(0)]);
    let plan = &call.plan;
    let (elem, out_elem) = call.element_bytes();

    device::with_device(index, |dev| {
        let own_stream = dev.stream;
        cuda_stream::ordered(order, dev, own_stream, |dev, stream| {
            let workspace = dev.workspace_for(stream)?;
            let handle = dev.handle;
            let prepared = prepared(dev, key)?;
            if let Some(ptr) = bias_ptr {
                prepared.desc.set_bias(ptr)?;
            }
            let desc = &prepared.desc;
            let accumulate = call.accumulate;
            let (alpha, beta) = (call.scale, if accumulate { 1.0f32 } else { 0.0 });
            let enqueue = |algo: &cublasLtMatmulAlgo_t, offsets: &[usize; 3]| {
                let a = rhs_ptr + offsets[1] as u64 * elem;
                let b = lhs_ptr + offsets[0] as u64 * elem;
                let d = out_ptr + offsets[2] as u64 * out_elem;
                // SAFETY: the addresses are live CubeCL buffers (held until
                // the call is enqueued) whose extents the plan respects;
                // `ordered` orders the call against CubeCL's stream.
                unsafe {
                    lt::matmul(
                        handle,
                        desc.desc,
                        &alpha as *const f32 as *const _,
                        &beta as *const f32 as *const _,
                        a as *const _,
                        desc.a,
                        b as *const _,
                        desc.b,
                        d as *const _,
                        desc.d,
                        d as *mut _,
                        desc.d,
                        algo,
                        workspace as *mut _,
                        device::WORKSPACE_BYTES,
                        stream as _,
                    )
                }
                .map_err(|e| KernelError::Launch(format!("cublasLtMatmul: {e:?}")))
            };
            let algo = match prepared.chosen {
                Some(algo) => algo,
                // Timing would add the product into `out` once per run: an
                // accumulating call takes the heuristic's choice, and the
                // problem's next overwriting call still times them.
                None if accumulate => prepared.candidates[0],
                None => {
                    let first = &plan.calls[0];
                    let flops = 2.0 * (plan.m * plan.n * plan.k * plan.batch) as f64;
                    tune::fastest(stream, flops, &prepared.candidates, |algo| {
                        enqueue(algo, first)
                    })?
                }
            };
            for offsets in &plan.calls {
                enqueue(&algo, offsets)?;
            }
            if !accumulate {
                prepared.chosen = Some(algo);
            }
            Ok(())
        })
    })
}
