//! Attention's kernel launches on `CubeBackend`: any batch/head/row
//! strides, read in place. The tiled and tensor-core kernels here, the
//! matrix-product path in `products.rs`.

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::ops::permute;
use burn_cubecl::tensor::CubeTensor;

use bastile_cubecl::KernelError;
use bastile_cubecl::attention::{
    self, AttentionBackwardBuffers, AttentionForwardBuffers, AttentionProblem, HeadLayout,
};
use cubecl::server::Handle;

use super::plan::AttentionDevice;
use super::{AttentionGrads, AttentionPlan, AttentionSpec, products};
use crate::backend::matmul::MatmulQuery;
use crate::fused::cube::contiguous_i32;
use crate::fused::{DeviceQuery, kernel, kernel_dtype, unpack};
use crate::launch_failure::launch;

/// What the device's kernels can do for query and key shapes `dims` of
/// `dtype` with these options.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionQuery {
    pub dims: [Shape; 2],
    pub dtype: DType,
    pub spec: AttentionSpec,
}

impl DeviceQuery for AttentionQuery {
    type Answer = AttentionDevice;

    fn ask<R: CubeRuntime>(&self, device: &R::Device) -> AttentionDevice {
        let client = R::client(device);
        let problem = problem(&self.dims, self.dtype, &self.spec, false, false);
        let supported = problem
            .as_ref()
            .is_some_and(|p| attention::supported(&client, p));
        let tensor_cores =
            kernel_dtype(self.dtype).is_some_and(|d| attention::mma::available(&client, d));
        let blas = MatmulQuery { dtype: self.dtype }.ask::<R>(device);
        AttentionDevice {
            supported,
            tensor_cores,
            cudnn: problem.is_some_and(|p| cudnn::takes::<R>(device, &p)),
            blas,
        }
    }
}

/// The forward launch: inputs `q, k, v, sinks?` and `key_lengths?,
/// doc_starts?`, outputs `out, lse`.
#[derive(Clone, Copy, Debug)]
pub(super) struct ForwardLaunch {
    pub spec: AttentionSpec,
    pub plan: AttentionPlan,
    pub has_sinks: bool,
}

kernel!(
    ForwardLaunch,
    "bastile_attention_forward",
    dispatch_at_once: true,
    |op, mut floats, mut ints| {
        let sinks = if op.has_sinks { floats.pop() } else { None };
        let [q, k, v] = unpack(floats);
        let doc_starts = if op.spec.documents { ints.pop() } else { None };
        let key_lengths = ints.pop();
        let tensors = Forwarded {
            q,
            k,
            v,
            sinks,
            key_lengths,
            doc_starts,
        };
        let (out, lse) = match op.plan {
            AttentionPlan::MatrixProducts { block_rows } => {
                products::forward::<R, F, I, BT>(tensors, op.spec, block_rows)
            }
            AttentionPlan::TensorCores { .. } | AttentionPlan::Tiled => {
                forward(tensors, op.spec, op.plan)
            }
        };
        vec![out, lse]
    }
);

/// The backward launch: inputs `q, k, v, out, lse, dout, sinks?` and
/// `key_lengths?, doc_starts?`, outputs `dq, dk, dv` and, with sinks, the sink gradient
/// per query row (f32 `[batch, heads, seq_q]`).
#[derive(Clone, Copy, Debug)]
pub(super) struct BackwardLaunch {
    pub spec: AttentionSpec,
    pub plan: AttentionPlan,
    pub has_sinks: bool,
}

kernel!(
    BackwardLaunch,
    "bastile_attention_backward",
    dispatch_at_once: true,
    |op, mut floats, mut ints| {
        let sinks = if op.has_sinks { floats.pop() } else { None };
        let [q, k, v, out, lse, dout] = unpack(floats);
        let doc_starts = if op.spec.documents { ints.pop() } else { None };
        let key_lengths = ints.pop();
        let tensors = Forwarded {
            q,
            k,
            v,
            sinks,
            key_lengths,
            doc_starts,
        };
        let (plan, spec) = (op.plan, op.spec);
        let g = match plan {
            AttentionPlan::MatrixProducts { block_rows } => {
                products::backward::<R, F, I, BT>(tensors, out, lse, dout, spec, block_rows)
            }
            AttentionPlan::TensorCores { .. } | AttentionPlan::Tiled => {
                backward(tensors, out, lse, dout, spec, plan)
            }
        };
        [Some(g.q), Some(g.k), Some(g.v), g.sinks]
            .into_iter()
            .flatten()
            .collect()
    }
);

/// The forward's tensors on `CubeBackend`.
pub(super) type Forwarded<R> = super::AttentionTensors<CubeTensor<R>, CubeTensor<R>>;

/// The problem for query and key shapes `[b, h, s, d]`, if the kernels
/// take it: float dtype, equal head dims, enough keys for a mask.
pub(super) fn problem(
    dims: &[Shape; 2],
    dtype: DType,
    spec: &AttentionSpec,
    sinks: bool,
    key_lengths: bool,
) -> Option<AttentionProblem> {
    let [q, k] = dims;
    if q.num_dims() != 4 || k.num_dims() != 4 {
        return None;
    }
    Some(AttentionProblem {
        batch: q[0],
        heads: q[1],
        kv_heads: k[1],
        seq_q: q[2],
        seq_k: k[2],
        head_dim: q[3],
        scale: spec.scale as f32,
        causal: spec.causal,
        window: spec.window,
        sinks,
        key_lengths,
        documents: spec.documents,
        dtype: kernel_dtype(dtype)?,
    })
}

/// The problem of a call whose support was checked before the launch.
pub(super) fn checked_problem<R: CubeRuntime>(
    t: &Forwarded<R>,
    spec: &AttentionSpec,
) -> AttentionProblem {
    let dims = [t.q.shape(), t.k.shape()];
    let (sinks, lengths) = (t.sinks.is_some(), t.key_lengths.is_some());
    problem(&dims, t.q.dtype, spec, sinks, lengths)
        .expect("attention support checked before the launch")
}

/// The tensor with a unit-stride head dim, and its layout.
pub(super) fn heads<R: CubeRuntime>(t: CubeTensor<R>) -> (CubeTensor<R>, HeadLayout) {
    let t = if t.meta.strides()[3] == 1 || t.shape()[3] == 1 {
        t
    } else {
        into_contiguous(t)
    };
    let s = t.meta.strides();
    let layout = HeadLayout {
        handle: t.handle.clone(),
        strides: [s[0], s[1], s[2]],
    };
    (t, layout)
}

/// A fresh tensor with a dense row-major layout. The kernels index their
/// outputs densely (and the f32 row statistics flatly), so the runtime's
/// pitched layouts (which pad a row of 37 floats, say) must not be used.
fn contiguous<R: CubeRuntime>(like: &CubeTensor<R>, shape: Shape, dtype: DType) -> CubeTensor<R> {
    empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, dtype)
}

/// A fresh `[batch, heads, seq, head_dim]` tensor stored as `[batch, seq,
/// heads, head_dim]`: a model reads the attention's output back as one
/// row per token (`swap_dims(1, 2)`, then a reshape to `[batch, seq,
/// heads · head_dim]`), which is then a view. Stored heads-major, that
/// read would copy it, and the output projection's autodiff node would
/// keep the copy beside the attention node's own.
fn seq_major<R: CubeRuntime>(like: &CubeTensor<R>, shape: Shape) -> (CubeTensor<R>, HeadLayout) {
    let [b, h, s, d] = [shape[0], shape[1], shape[2], shape[3]];
    let t = contiguous(like, Shape::new([b, s, h, d]), like.dtype);
    let layout = HeadLayout {
        handle: t.handle.clone(),
        strides: [s * h * d, d, h * d],
    };
    (permute(t, &[0, 2, 1, 3]), layout)
}

/// Sinks as contiguous f32.
pub(super) fn sinks_f32<R: CubeRuntime>(s: CubeTensor<R>) -> CubeTensor<R> {
    let s = if s.dtype == DType::F32 {
        s
    } else {
        burn_cubecl::kernel::cast(s, DType::F32)
    };
    into_contiguous(s)
}

/// The forward's tensors laid out for the tiled and tensor-core kernels:
/// `q`, `k` and `v` with a unit-stride head dim, sinks as f32, key lengths
/// and document starts as i32. The tensors stay alive until the launch
/// is queued.
struct LaidOut<R: CubeRuntime> {
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    _v: CubeTensor<R>,
    layouts: [HeadLayout; 3],
    sinks: Option<CubeTensor<R>>,
    key_lengths: Option<CubeTensor<R>>,
    doc_starts: Option<CubeTensor<R>>,
}

impl<R: CubeRuntime> LaidOut<R> {
    fn new(t: Forwarded<R>) -> Self {
        let (q, q_l) = heads(t.q);
        let (k, k_l) = heads(t.k);
        let (v, v_l) = heads(t.v);
        Self {
            q,
            k,
            _v: v,
            layouts: [q_l, k_l, v_l],
            sinks: t.sinks.map(sinks_f32),
            key_lengths: t.key_lengths.map(contiguous_i32),
            doc_starts: t.doc_starts.map(contiguous_i32),
        }
    }

    /// An f32 value per query row (`[batch, heads, seq_q]`).
    fn row_stats(&self) -> CubeTensor<R> {
        let [b, h, sq, _] = self.q.shape().dims();
        contiguous(&self.q, Shape::new([b, h, sq]), DType::F32)
    }

    fn sinks_handle(&self) -> Option<Handle> {
        self.sinks.as_ref().map(|s| s.handle.clone())
    }

    fn key_lengths_handle(&self) -> Option<Handle> {
        self.key_lengths.as_ref().map(|l| l.handle.clone())
    }

    fn doc_starts_handle(&self) -> Option<Handle> {
        self.doc_starts.as_ref().map(|s| s.handle.clone())
    }
}

/// Runs `plan`'s launches: cuDNN's when it asks for them, else (or when
/// cuDNN refuses the problem) the tensor-core launch when it asks for the
/// tensor cores, and the tiled one otherwise or when the tensor cores
/// refuse the problem or layout; `kernel` names the launch in a [launch
/// failure](crate::launch_failure).
fn cudnn_tensor_cores_or_tiled(
    plan: AttentionPlan,
    fused: impl FnOnce() -> Result<(), KernelError>,
    mma: impl FnOnce() -> Result<(), KernelError>,
    tiled: impl Fn() -> Result<(), KernelError>,
    kernel: &str,
) {
    let (cudnn, tensor_cores) = match plan {
        AttentionPlan::TensorCores { cudnn, .. } => (cudnn, true),
        AttentionPlan::MatrixProducts { .. } | AttentionPlan::Tiled => (false, false),
    };
    launch(kernel, || {
        if cudnn {
            match fused() {
                // Refused: the problem goes on to Bastile's kernels.
                Err(KernelError::Unsupported(_)) => {}
                result => return result,
            }
        }
        if tensor_cores {
            mma().or_else(|_| tiled())
        } else {
            tiled()
        }
    });
}

/// The cuDNN, tensor-core or tiled forward, as `plan` says.
fn forward<R: CubeRuntime>(
    t: Forwarded<R>,
    spec: AttentionSpec,
    plan: AttentionPlan,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let problem = checked_problem(&t, &spec);
    let t = LaidOut::new(t);
    let (out, out_l) = seq_major(&t.q, t.q.shape());
    let lse = t.row_stats();
    let [q_l, k_l, v_l] = t.layouts.clone();
    let buffers = AttentionForwardBuffers {
        q: q_l,
        k: k_l,
        v: v_l,
        out: out_l,
        lse: lse.handle.clone(),
        sinks: t.sinks_handle(),
        key_lengths: t.key_lengths_handle(),
        doc_starts: t.doc_starts_handle(),
    };
    let (client, device) = (&t.q.client, &t.q.device);
    cudnn_tensor_cores_or_tiled(
        plan,
        || cudnn::forward::<R>(client, device, &problem, &buffers),
        || attention::mma::forward(client, device, &problem, &buffers),
        || attention::forward(client, device, &problem, &buffers),
        "attention forward",
    );
    (out, lse)
}

/// The cuDNN, tensor-core or tiled backward, as `plan` says; on the
/// tensor cores of a deterministic plan, the form without atomics.
fn backward<R: CubeRuntime>(
    t: Forwarded<R>,
    out: CubeTensor<R>,
    lse: CubeTensor<R>,
    dout: CubeTensor<R>,
    spec: AttentionSpec,
    plan: AttentionPlan,
) -> AttentionGrads<CubeTensor<R>> {
    let deterministic = matches!(
        plan,
        AttentionPlan::TensorCores {
            deterministic: true,
            ..
        }
    );
    let problem = checked_problem(&t, &spec);
    let t = LaidOut::new(t);
    let (_out, out_l) = heads(out);
    let (_dout, dout_l) = heads(dout);
    let lse = into_contiguous(lse);
    // Stored like the projections they flow back into: a model's views
    // (`swap_dims(1, 2)`, then a reshape to one row per token) are then
    // views of the gradients too, where heads-major storage would copy.
    let (dq, dq_l) = seq_major(&t.q, t.q.shape());
    let (dk, dk_l) = seq_major(&t.k, t.k.shape());
    let (dv, dv_l) = seq_major(&t.k, t.k.shape());
    let delta = t.row_stats();
    let dsink_rows = t.sinks.as_ref().map(|_| t.row_stats());
    let [q_l, k_l, v_l] = t.layouts.clone();
    let buffers = AttentionBackwardBuffers {
        q: q_l,
        k: k_l,
        v: v_l,
        out: out_l,
        dout: dout_l,
        lse: lse.handle.clone(),
        sinks: t.sinks_handle(),
        key_lengths: t.key_lengths_handle(),
        doc_starts: t.doc_starts_handle(),
        dq: dq_l,
        dk: dk_l,
        dv: dv_l,
        delta: delta.handle.clone(),
        dsink_rows: dsink_rows.as_ref().map(|d| d.handle.clone()),
    };
    let (client, device) = (&t.q.client, &t.q.device);
    cudnn_tensor_cores_or_tiled(
        plan,
        || cudnn::backward::<R>(client, device, &problem, &buffers),
        || match deterministic {
            true => attention::mma::backward_deterministic(client, &problem, &buffers),
            false => attention::mma::backward(client, device, &problem, &buffers),
        },
        || attention::backward(client, device, &problem, &buffers),
        "attention backward",
    );
    AttentionGrads {
        q: dq,
        k: dk,
        v: dv,
        sinks: dsink_rows,
    }
}

/// cuDNN's fused attention, on the CUDA runtime only.
#[cfg(feature = "cuda")]
mod cudnn {
    use bastile_cubecl::KernelError;
    use bastile_cubecl::attention::{
        self, AttentionBackwardBuffers, AttentionForwardBuffers, AttentionProblem,
    };
    use burn_cubecl::CubeRuntime;
    use cubecl::cuda::CudaRuntime;
    use cubecl::prelude::ComputeClient;

    use crate::backend::matmul::{cuda_client, cuda_device_index};
    use crate::launch_failure::failed;

    /// Whether cuDNN is loaded on `device` and its graphs express
    /// `problem`.
    pub fn takes<R: CubeRuntime>(device: &R::Device, problem: &AttentionProblem) -> bool {
        attention::cudnn::takes(problem)
            && cuda_device_index::<R>(device).is_some_and(bastile_cubecl::cudnn::available)
    }

    /// The CUDA client and device ordinal, or `Unsupported` elsewhere.
    fn cuda<'a, R: CubeRuntime>(
        client: &'a ComputeClient<R>,
        device: &R::Device,
    ) -> Result<(&'a ComputeClient<CudaRuntime>, usize), KernelError> {
        cuda_client::<R>(client, device)
            .ok_or_else(|| KernelError::Unsupported("cuDNN runs on CUDA only".into()))
    }

    pub fn forward<R: CubeRuntime>(
        client: &ComputeClient<R>,
        device: &R::Device,
        problem: &AttentionProblem,
        buffers: &AttentionForwardBuffers,
    ) -> Result<(), KernelError> {
        let (client, index) = cuda::<R>(client, device)?;
        attention::cudnn::forward(client, index, problem, buffers, |e| {
            failed("cuDNN attention forward", e)
        })
    }

    pub fn backward<R: CubeRuntime>(
        client: &ComputeClient<R>,
        device: &R::Device,
        problem: &AttentionProblem,
        buffers: &AttentionBackwardBuffers,
    ) -> Result<(), KernelError> {
        let (client, index) = cuda::<R>(client, device)?;
        attention::cudnn::backward(client, index, problem, buffers, |e| {
            failed("cuDNN attention backward", e)
        })
    }
}

/// Without the `cuda` feature there is no cuDNN path.
#[cfg(not(feature = "cuda"))]
mod cudnn {
    use bastile_cubecl::KernelError;
    use bastile_cubecl::attention::{
        AttentionBackwardBuffers, AttentionForwardBuffers, AttentionProblem,
    };
    use burn_cubecl::CubeRuntime;
    use cubecl::prelude::ComputeClient;

    pub fn takes<R: CubeRuntime>(_device: &R::Device, _problem: &AttentionProblem) -> bool {
        false
    }

    fn absent() -> KernelError {
        KernelError::Unsupported("built without the `cuda` feature".into())
    }

    pub fn forward<R: CubeRuntime>(
        _client: &ComputeClient<R>,
        _device: &R::Device,
        _problem: &AttentionProblem,
        _buffers: &AttentionForwardBuffers,
    ) -> Result<(), KernelError> {
        Err(absent())
    }

    pub fn backward<R: CubeRuntime>(
        _client: &ComputeClient<R>,
        _device: &R::Device,
        _problem: &AttentionProblem,
        _buffers: &AttentionBackwardBuffers,
    ) -> Result<(), KernelError> {
        Err(absent())
    }
}
