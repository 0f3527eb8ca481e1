//! Matmuls through cuBLASLt on CubeCL's CUDA buffers.
//!
//! The operands are CubeCL handles; their device addresses come from
//! `ComputeClient::get_resource`, which also keeps the memory alive while
//! the call runs. The library, a workspace and each problem's descriptors
//! and algorithm are kept per device ([`device`]); for short products the
//! algorithm is the fastest of the heuristic's candidates on the problem's
//! first call ([`tune`]). [`order`] enqueues the calls on CubeCL's own
//! stream when it can observe it, else orders them by host synchronization.

mod algo;
mod device;
mod order;
mod stream_probe;
mod tune;

use std::sync::atomic::{AtomicBool, Ordering};

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::ComputeClient;
use cubecl::server::Handle;
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys::cublasLtMatmulAlgo_t;
use cudarc::driver::sys::CUstream;

use crate::gemm_layout::GemmPlan;
use crate::{FloatDtype, KernelError};

pub use order::{OrderMode, force_host_sync, order_mode};

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
pub fn gemm(
    client: &ComputeClient<CudaRuntime>,
    index: usize,
    dtypes: GemmDtypes,
    plan: &GemmPlan,
    buffers: GemmBuffers<'_>,
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
    let same = order::same_stream(client, index);
    // The stream crosses to the device thread as an address (raw pointers
    // are not `Send`).
    let stream_addr = same.map(|s| s as usize);
    let run = || {
        let same = stream_addr.map(|s| s as CUstream);
        launch(client, index, same, dtypes, plan, &buffers)
    };
    match same {
        // On CubeCL's device thread the operands' resource look-ups run in
        // place; from any other thread each one is a round trip to it
        // (~10 µs, several per call: more than a small product takes).
        // Host-synchronized ordering waits on CubeCL's stream, which must
        // not happen from inside that thread.
        Some(_) => client
            .exclusive(run)
            .map_err(|e| KernelError::Launch(format!("CubeCL's device thread: {e:?}")))?,
        None => run(),
    }
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

/// [`gemm`]'s work once the ordering mode is known (`same`: CubeCL's
/// stream, or `None` for host synchronization).
fn launch(
    client: &ComputeClient<CudaRuntime>,
    index: usize,
    same: Option<CUstream>,
    dtypes: GemmDtypes,
    plan: &GemmPlan,
    buffers: &GemmBuffers<'_>,
) -> Result<(), KernelError> {
    let resource = |h: &Handle| {
        client
            .get_resource(h.clone())
            .map_err(|e| KernelError::Launch(format!("buffer address: {e:?}")))
    };
    let lhs = resource(buffers.lhs)?;
    let rhs = resource(buffers.rhs)?;
    let out = resource(buffers.out)?;
    let bias = buffers.bias.map(resource).transpose()?;
    let (lhs_ptr, rhs_ptr, out_ptr) = (lhs.resource().ptr, rhs.resource().ptr, out.resource().ptr);
    let bias_ptr = bias.as_ref().map(|b| b.resource().ptr);

    // The alignment every matrix of every call shares.
    let (elem, out_elem) = (dtypes.operands.size() as u64, dtypes.out.size() as u64);
    let align_of = |base: u64, slot: usize, batch_stride: usize, elem: u64| {
        plan.calls
            .iter()
            .map(|c| algo::alignment(base + c[slot] as u64 * elem))
            .chain((plan.batch > 1).then(|| algo::alignment(batch_stride as u64 * elem)))
            .min()
            .unwrap_or(256)
    };
    let bias_batch_stride = bias_batch_stride(plan, buffers);
    let align = [
        align_of(rhs_ptr, 1, plan.a.batch_stride, elem),
        align_of(lhs_ptr, 0, plan.b.batch_stride, elem),
        align_of(out_ptr, 2, plan.d_batch_stride, out_elem),
        bias_ptr.map_or(256, |b| {
            let stride = (bias_batch_stride > 0).then(|| bias_batch_stride as u64 * elem);
            algo::alignment(b).min(stride.map_or(256, algo::alignment))
        }),
    ];
    let epilogue_bias = bias_ptr.map(|_| algo::Bias {
        batch_stride: bias_batch_stride,
        grad: buffers.bias_grad,
    });
    let key = algo::key(
        plan,
        [dtypes.operands, dtypes.out],
        tf32(),
        epilogue_bias,
        align,
    );

    device::with_device(index, |dev| {
        dev.make_current()?;
        order::ordered(client, same, dev, |dev, stream, workspace| {
            let handle = dev.handle;
            let prepared = match dev.prepared.entry(key) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(algo::Prepared::new(&key, handle)?)
                }
            };
            let prepared = prepared.as_mut().ok_or_else(|| {
                KernelError::Unsupported(format!("cuBLASLt has no algorithm for {key:?}"))
            })?;
            if let Some(ptr) = bias_ptr {
                prepared.desc.set_bias(ptr)?;
            }
            let desc = &prepared.desc;
            let (alpha, beta) = (buffers.scale, if buffers.accumulate { 1.0f32 } else { 0.0 });
            let call = |algo: &cublasLtMatmulAlgo_t, call: &[usize; 3]| {
                let a = rhs_ptr + call[1] as u64 * elem;
                let b = lhs_ptr + call[0] as u64 * elem;
                let d = out_ptr + call[2] as u64 * out_elem;
                // SAFETY: the addresses are live CubeCL buffers (held by
                // the resources above) whose extents the plan respects;
                // `order::ordered` orders the call against CubeCL's stream.
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
                None if buffers.accumulate => prepared.candidates[0],
                None => {
                    let first = &plan.calls[0];
                    let flops = 2.0 * (plan.m * plan.n * plan.k * plan.batch) as f64;
                    tune::fastest(stream, flops, &prepared.candidates, |algo| {
                        call(algo, first)
                    })?
                }
            };
            for c in &plan.calls {
                call(&algo, c)?;
            }
            if !buffers.accumulate {
                prepared.chosen = Some(algo);
            }
            Ok(())
        })
    })?;
    // The resources (and with them the buffers) are released only now.
    drop((lhs, rhs, out, bias));
    Ok(())
}
