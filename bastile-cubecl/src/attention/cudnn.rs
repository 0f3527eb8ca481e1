//! Attention on cuDNN's fused scaled-dot-product kernels (CUDA, cuDNN 9):
//! on Hopper these are warpgroup (`wgmma`) kernels that CubeCL's kernel
//! language cannot express, the ones PyTorch's default attention runs.
//!
//! The graphs are the ones cuDNN's engines recognise as attention: the
//! forward `S = scale · Q·Kᵀ`, the causal mask (top-left aligned, which is
//! Burn's bottom-right one when `seq_q = seq_k`), the softmax with its
//! log-sum-exp (the same `lse` the other paths save, so their backward
//! kernels and this one pair with any forward) and `O = P·V`; the backward
//! recomputes `P` from `lse`, forms `Δ = Σ dO·O` into the problem's
//! `delta` buffer, and `dV = Pᵀ·dO`, `dS = P·(dO·Vᵀ − Δ)·scale`,
//! `dK = dSᵀ·Q`, `dQ = dS·K`, the query heads of a key/value head summed
//! for dK and dV and dQ accumulated in f32. They take every batch, head
//! and row stride of the other paths; sliding windows, sinks, key lengths
//! and documents stay on Bastile's own kernels ([`takes`]).

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::{LazyLock, Mutex};

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::ComputeClient;
use cubecl::server::{Binding, Handle};
use cudarc::cudnn::sys::{
    cudnnDataType_t as DataType, cudnnPointwiseMode_t as Pointwise, cudnnReduceTensorOp_t as Reduce,
};
use cudarc::driver::result as drv;

use super::{
    AttentionBackwardBuffers, AttentionForwardBuffers, AttentionProblem, HeadLayout,
    half_rows_in_vectors,
};
use crate::cuda_stream::{self, Addresses, Order};
use crate::cudnn::{self, Graph, Layout, Plan, SCALAR, Scalar, Storage, Uid};
use crate::{FloatDtype, KernelError};

// The ids of the tensors a call passes.
const Q: Uid = 1;
const K: Uid = 2;
const V: Uid = 3;
const O: Uid = 4;
const LSE: Uid = 5;
const SCALE: Uid = 6;
const NEG_INF: Uid = 7;
const DO: Uid = 8;
const DQ: Uid = 9;
const DK: Uid = 10;
const DV: Uid = 11;
const ONE: Uid = 12;
const DELTA: Uid = 13;
const DQ_ACC: Uid = 14;

const F32: DataType = DataType::CUDNN_DATA_FLOAT;

/// Whether these graphs express `problem`: f16 or bf16, no sliding window,
/// sinks, key lengths or documents, a causal mask only with as many keys
/// as queries, more than one query or key (cuDNN's engines refuse a
/// single one of each), and a head dim they take (a multiple of 8 up to
/// 256). cuDNN may still refuse a problem when its plan is built.
pub fn takes(problem: &AttentionProblem) -> bool {
    let p = problem;
    p.dtype != FloatDtype::F32
        && (p.seq_q > 1 || p.seq_k > 1)
        && p.window.is_none()
        && !p.sinks
        && !p.key_lengths
        && !p.documents
        && (!p.causal || p.seq_q == p.seq_k)
        && p.head_dim.is_multiple_of(8)
        && p.head_dim <= 256
}

fn io_type(dtype: FloatDtype) -> DataType {
    match dtype {
        FloatDtype::F16 => DataType::CUDNN_DATA_HALF,
        _ => DataType::CUDNN_DATA_BFLOAT16,
    }
}

/// The problem's extents as cuDNN's dims.
#[derive(Clone, Copy)]
struct Extents {
    b: i64,
    h: i64,
    hk: i64,
    sq: i64,
    sk: i64,
    d: i64,
}

impl Extents {
    fn new(p: &AttentionProblem) -> Self {
        let i = |v: usize| v as i64;
        Self {
            b: i(p.batch),
            h: i(p.heads),
            hk: i(p.kv_heads),
            sq: i(p.seq_q),
            sk: i(p.seq_k),
            d: i(p.head_dim),
        }
    }

    /// `[b, h, sq, sk]`, dense: the scores and everything derived from
    /// them.
    fn scores(&self) -> Layout {
        let Self { b, h, sq, sk, .. } = *self;
        ([b, h, sq, sk], [h * sq * sk, sq * sk, sk, 1])
    }

    /// `[b, h, sk, sq]`: the scores transposed, a view of [`Self::scores`].
    fn scores_transposed(&self) -> Layout {
        let Self { b, h, sq, sk, .. } = *self;
        ([b, h, sk, sq], [h * sq * sk, sq * sk, 1, sk])
    }

    /// `[b, h, sq, 1]`, dense: one value per query row (`lse`, `Δ`).
    fn rows(&self) -> Layout {
        let Self { b, h, sq, .. } = *self;
        ([b, h, sq, 1], [h * sq, sq, 1, 1])
    }

    /// Dense `[b, heads, seq, d]`.
    fn dense(&self, heads: i64, seq: i64) -> Layout {
        let (b, d) = (self.b, self.d);
        ([b, heads, seq, d], [heads * seq * d, seq * d, d, 1])
    }
}

/// A `[b, heads, seq, d]` tensor in `layout`, or (`transposed`) the view
/// `[b, heads, d, seq]` of it that a product reads as its right operand.
fn head_tensor(
    g: &mut Graph,
    uid: Uid,
    dtype: DataType,
    layout: &HeadLayout,
    [b, heads, seq, d]: [i64; 4],
    transposed: bool,
) -> Result<Uid, KernelError> {
    let [sb, sh, ss] = layout.strides.map(|s| s as i64);
    let layout = if transposed {
        ([b, heads, d, seq], [sb, sh, 1, ss])
    } else {
        ([b, heads, seq, d], [sb, sh, ss, 1])
    };
    g.tensor(uid, dtype, layout, Storage::Buffer)
}

/// `scores` with every key after its query (top-left aligned) set to −∞
/// (the by-value [`NEG_INF`]).
fn causal_mask(g: &mut Graph, scores: Uid, e: &Extents) -> Result<Uid, KernelError> {
    let index = |g: &mut Graph, axis: i64| {
        let i = g.virt(DataType::CUDNN_DATA_INT32, e.scores())?;
        g.pointwise(
            Pointwise::CUDNN_POINTWISE_GEN_INDEX,
            scores,
            None,
            None,
            i,
            Some(axis),
            F32,
        )?;
        Ok::<_, KernelError>(i)
    };
    let (row, col) = (index(g, 2)?, index(g, 3)?);
    let seen = g.virt(DataType::CUDNN_DATA_BOOLEAN, e.scores())?;
    g.pointwise(
        Pointwise::CUDNN_POINTWISE_CMP_GE,
        row,
        Some(col),
        None,
        seen,
        None,
        DataType::CUDNN_DATA_BOOLEAN,
    )?;
    g.tensor(NEG_INF, F32, SCALAR, Storage::Scalar)?;
    let masked = g.virt(F32, e.scores())?;
    g.pointwise(
        Pointwise::CUDNN_POINTWISE_BINARY_SELECT,
        scores,
        Some(NEG_INF),
        Some(seen),
        masked,
        None,
        F32,
    )?;
    Ok(masked)
}

/// `y = mode(x, b)` in f32, `y` a new virtual tensor of `x`'s shape.
fn binary(
    g: &mut Graph,
    mode: Pointwise,
    x: Uid,
    b: Option<Uid>,
    layout: Layout,
) -> Result<Uid, KernelError> {
    let y = g.virt(F32, layout)?;
    g.pointwise(mode, x, b, None, y, None, F32)?;
    Ok(y)
}

/// The scaled scores `scale · Q·Kᵀ`.
fn scaled_scores(g: &mut Graph, e: &Extents) -> Result<Uid, KernelError> {
    let s = g.virt(F32, e.scores())?;
    g.matmul(Q, K, s)?;
    g.tensor(SCALE, F32, SCALAR, Storage::Scalar)?;
    binary(
        g,
        Pointwise::CUDNN_POINTWISE_MUL,
        s,
        Some(SCALE),
        e.scores(),
    )
}

fn forward_graph(
    p: &AttentionProblem,
    buffers: &AttentionForwardBuffers,
) -> Result<Graph, KernelError> {
    let (e, io) = (Extents::new(p), io_type(p.dtype));
    let (queries, keys) = ([e.b, e.h, e.sq, e.d], [e.b, e.hk, e.sk, e.d]);
    let mut g = Graph::new();
    head_tensor(&mut g, Q, io, &buffers.q, queries, false)?;
    head_tensor(&mut g, K, io, &buffers.k, keys, true)?;
    head_tensor(&mut g, V, io, &buffers.v, keys, false)?;
    head_tensor(&mut g, O, io, &buffers.out, queries, false)?;
    g.tensor(LSE, F32, e.rows(), Storage::Buffer)?;
    let mut s = scaled_scores(&mut g, &e)?;
    if p.causal {
        s = causal_mask(&mut g, s, &e)?;
    }
    let max = g.virt(F32, e.rows())?;
    g.reduce(Reduce::CUDNN_REDUCE_TENSOR_MAX, s, max)?;
    let shifted = binary(
        &mut g,
        Pointwise::CUDNN_POINTWISE_SUB,
        s,
        Some(max),
        e.scores(),
    )?;
    let exp = binary(
        &mut g,
        Pointwise::CUDNN_POINTWISE_EXP,
        shifted,
        None,
        e.scores(),
    )?;
    let sum = g.virt(F32, e.rows())?;
    g.reduce(Reduce::CUDNN_REDUCE_TENSOR_ADD, exp, sum)?;
    let log_sum = binary(&mut g, Pointwise::CUDNN_POINTWISE_LOG, sum, None, e.rows())?;
    g.pointwise(
        Pointwise::CUDNN_POINTWISE_ADD,
        max,
        Some(log_sum),
        None,
        LSE,
        None,
        F32,
    )?;
    let probs = g.virt(io, e.scores())?;
    g.pointwise(
        Pointwise::CUDNN_POINTWISE_DIV,
        exp,
        Some(sum),
        None,
        probs,
        None,
        F32,
    )?;
    g.matmul(probs, V, O)?;
    Ok(g)
}

fn backward_graph(
    p: &AttentionProblem,
    buffers: &AttentionBackwardBuffers,
) -> Result<Graph, KernelError> {
    let (e, io) = (Extents::new(p), io_type(p.dtype));
    let (queries, keys) = ([e.b, e.h, e.sq, e.d], [e.b, e.hk, e.sk, e.d]);
    let b = buffers;
    let mut g = Graph::new();
    head_tensor(&mut g, Q, io, &b.q, queries, false)?;
    head_tensor(&mut g, K, io, &b.k, keys, true)?;
    head_tensor(&mut g, V, io, &b.v, keys, true)?;
    head_tensor(&mut g, O, io, &b.out, queries, false)?;
    head_tensor(&mut g, DO, io, &b.dout, queries, false)?;
    head_tensor(&mut g, DQ, io, &b.dq, queries, false)?;
    head_tensor(&mut g, DK, io, &b.dk, keys, false)?;
    head_tensor(&mut g, DV, io, &b.dv, keys, false)?;
    g.tensor(LSE, F32, e.rows(), Storage::Buffer)?;
    g.tensor(DELTA, F32, e.rows(), Storage::Buffer)?;
    g.tensor(DQ_ACC, F32, e.dense(e.h, e.sq), Storage::Buffer)?;

    // Δ = Σ_d dO·O, per query row.
    let products = binary(
        &mut g,
        Pointwise::CUDNN_POINTWISE_MUL,
        DO,
        Some(O),
        e.dense(e.h, e.sq),
    )?;
    let row_sums = g.virt(F32, e.rows())?;
    g.reduce(Reduce::CUDNN_REDUCE_TENSOR_ADD, products, row_sums)?;
    g.tensor(ONE, F32, SCALAR, Storage::Scalar)?;
    g.pointwise(
        Pointwise::CUDNN_POINTWISE_MUL,
        row_sums,
        Some(ONE),
        None,
        DELTA,
        None,
        F32,
    )?;

    // P = exp(S − lse), recomputed.
    let s = scaled_scores(&mut g, &e)?;
    let mut shifted = binary(
        &mut g,
        Pointwise::CUDNN_POINTWISE_SUB,
        s,
        Some(LSE),
        e.scores(),
    )?;
    if p.causal {
        shifted = causal_mask(&mut g, shifted, &e)?;
    }
    let probs = binary(
        &mut g,
        Pointwise::CUDNN_POINTWISE_EXP,
        shifted,
        None,
        e.scores(),
    )?;
    let probs_t = g.virt(io, e.scores_transposed())?;
    g.reshape(probs, probs_t)?;
    key_gradient(&mut g, probs_t, DO, DV, p, &e, io)?;

    // dS = P·(dO·Vᵀ − Δ)·scale.
    let dp = g.virt(F32, e.scores())?;
    g.matmul(DO, V, dp)?;
    let centred = binary(
        &mut g,
        Pointwise::CUDNN_POINTWISE_SUB,
        dp,
        Some(DELTA),
        e.scores(),
    )?;
    let weighted = binary(
        &mut g,
        Pointwise::CUDNN_POINTWISE_MUL,
        centred,
        Some(probs),
        e.scores(),
    )?;
    let ds = binary(
        &mut g,
        Pointwise::CUDNN_POINTWISE_MUL,
        weighted,
        Some(SCALE),
        e.scores(),
    )?;
    let ds_t = g.virt(io, e.scores_transposed())?;
    g.reshape(ds, ds_t)?;
    key_gradient(&mut g, ds_t, Q, DK, p, &e, io)?;

    // dQ = dS·K, accumulated in f32, then rounded into dq.
    let k_rows = g.virt(F32, e.dense(e.hk, e.sk))?;
    g.reshape(K, k_rows)?;
    g.matmul(ds, k_rows, DQ_ACC)?;
    g.pointwise(
        Pointwise::CUDNN_POINTWISE_IDENTITY,
        DQ_ACC,
        None,
        None,
        DQ,
        None,
        F32,
    )?;
    Ok(g)
}

/// `out = lhs_t · rhs` (`[b, h, sk, sq]` by `[b, h, sq, d]`), the query
/// heads of each key/value head summed when there are more of them.
fn key_gradient(
    g: &mut Graph,
    lhs_t: Uid,
    rhs: Uid,
    out: Uid,
    p: &AttentionProblem,
    e: &Extents,
    io: DataType,
) -> Result<(), KernelError> {
    if p.heads == p.kv_heads {
        return g.matmul(lhs_t, rhs, out);
    }
    let per_head = g.virt(io, e.dense(e.h, e.sk))?;
    g.matmul(lhs_t, rhs, per_head)?;
    g.reduce(Reduce::CUDNN_REDUCE_TENSOR_ADD, per_head, out)
}

/// What a plan is built for: the problem and every buffer's strides.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct PlanKey {
    device: usize,
    backward: bool,
    dims: [usize; 6],
    dtype: FloatDtype,
    causal: bool,
    strides: [[usize; 3]; 8],
}

impl PlanKey {
    fn new(device: usize, p: &AttentionProblem, backward: bool, layouts: &[&HeadLayout]) -> Self {
        let mut strides = [[0; 3]; 8];
        for (s, l) in strides.iter_mut().zip(layouts) {
            *s = l.strides;
        }
        Self {
            device,
            backward,
            dims: [p.batch, p.heads, p.kv_heads, p.seq_q, p.seq_k, p.head_dim],
            dtype: p.dtype,
            causal: p.causal,
            strides,
        }
    }
}

/// Built plans, and why a problem was refused (so it is not rebuilt).
static PLANS: LazyLock<Mutex<HashMap<PlanKey, Result<Plan, KernelError>>>> =
    LazyLock::new(Default::default);

/// The workspace bytes of `key`'s plan, built by `graph` on first use.
fn prepared(
    key: PlanKey,
    graph: impl FnOnce() -> Result<Graph, KernelError>,
) -> Result<usize, KernelError> {
    cudnn::with_device(key.device, |dev| {
        let mut plans = PLANS.lock().unwrap_or_else(|p| p.into_inner());
        let plan = match plans.entry(key) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => e.insert(graph().and_then(|g| g.plan(dev.handle))),
        };
        match plan {
            Ok(plan) => Ok(plan.workspace),
            Err(e) => Err(e.clone()),
        }
    })
}

/// The problem on these buffers is one the graphs take.
fn ready(p: &AttentionProblem, layouts: &[&HeadLayout]) -> Result<(), KernelError> {
    p.validate()?;
    if !takes(p) {
        return Err(KernelError::Unsupported(format!(
            "cuDNN's attention graphs do not express {p:?}"
        )));
    }
    // 16-byte aligned rows, as the graphs declare.
    half_rows_in_vectors(layouts, "cuDNN's attention")
}

/// One call of a plan with its buffers, owned so it can cross to CubeCL's
/// device thread.
struct Call {
    key: PlanKey,
    buffers: Vec<(Uid, Binding)>,
    scalars: Vec<Scalar>,
    workspace: Binding,
    /// A buffer the call needs zeroed first, and its bytes.
    zeroed: Option<(Binding, usize)>,
}

/// Runs the forward on CUDA device `index` through cuDNN.
/// `Err(Unsupported)` when the graphs or cuDNN do not take the problem
/// (nothing was enqueued: the caller can take another path). On CubeCL's
/// own stream the call is handed to CubeCL's device thread and this
/// returns at once; an error met there goes to `on_error`.
pub fn forward(
    client: &ComputeClient<CudaRuntime>,
    index: usize,
    problem: &AttentionProblem,
    buffers: &AttentionForwardBuffers,
    on_error: impl FnOnce(KernelError) + Send + 'static,
) -> Result<(), KernelError> {
    let (p, b) = (problem, buffers);
    let layouts = b.layouts();
    ready(p, &layouts)?;
    b.check(p)?;
    let key = PlanKey::new(index, p, false, &layouts);
    let tensors = vec![
        (Q, b.q.handle.clone()),
        (K, b.k.handle.clone()),
        (V, b.v.handle.clone()),
        (O, b.out.handle.clone()),
        (LSE, b.lse.clone()),
    ];
    let graph = || forward_graph(p, b);
    run(client, p, key, graph, tensors, None, on_error)
}

/// Runs the backward on CUDA device `index` through cuDNN, as [`forward`]
/// does; `delta` receives `Δ`.
pub fn backward(
    client: &ComputeClient<CudaRuntime>,
    index: usize,
    problem: &AttentionProblem,
    buffers: &AttentionBackwardBuffers,
    on_error: impl FnOnce(KernelError) + Send + 'static,
) -> Result<(), KernelError> {
    let (p, b) = (problem, buffers);
    let layouts = b.layouts();
    ready(p, &layouts)?;
    b.check(p, false)?;
    let key = PlanKey::new(index, p, true, &layouts);
    let acc_bytes = p.query_rows() * p.head_dim * 4;
    let dq_acc = client.empty(acc_bytes);
    let tensors = vec![
        (Q, b.q.handle.clone()),
        (K, b.k.handle.clone()),
        (V, b.v.handle.clone()),
        (O, b.out.handle.clone()),
        (DO, b.dout.handle.clone()),
        (DQ, b.dq.handle.clone()),
        (DK, b.dk.handle.clone()),
        (DV, b.dv.handle.clone()),
        (LSE, b.lse.clone()),
        (DELTA, b.delta.clone()),
        (DQ_ACC, dq_acc.clone()),
    ];
    let graph = || backward_graph(p, b);
    run(
        client,
        p,
        key,
        graph,
        tensors,
        Some((dq_acc, acc_bytes)),
        on_error,
    )
}

/// Builds `key`'s plan on first use (`graph`), then enqueues it on
/// `buffers` with the problem's scalars, zeroing `zeroed` first.
fn run(
    client: &ComputeClient<CudaRuntime>,
    p: &AttentionProblem,
    key: PlanKey,
    graph: impl FnOnce() -> Result<Graph, KernelError>,
    buffers: Vec<(Uid, Handle)>,
    zeroed: Option<(Handle, usize)>,
    on_error: impl FnOnce(KernelError) + Send + 'static,
) -> Result<(), KernelError> {
    let workspace = prepared(key, graph)?;
    let mut scalars = vec![Scalar(SCALE, p.scale)];
    if key.backward {
        scalars.push(Scalar(ONE, 1.0));
    }
    if p.causal {
        scalars.push(Scalar(NEG_INF, f32::NEG_INFINITY));
    }
    let call = Call {
        key,
        buffers: buffers
            .iter()
            .map(|(uid, h)| (*uid, cuda_stream::as_queued(h)))
            .collect(),
        scalars,
        workspace: cuda_stream::as_queued(&client.empty(workspace.max(16))),
        zeroed: zeroed.map(|(h, bytes)| (cuda_stream::as_queued(&h), bytes)),
    };
    let enqueue =
        move |order: Order<'_>, address: &mut Addresses<'_>| enqueue(order, &call, address);
    cuda_stream::submit(client, key.device, enqueue, on_error)
}

/// [`run`]'s work once the ordering is known; `address` gives a buffer's
/// device address (and keeps it alive until the call is enqueued).
fn enqueue(order: Order<'_>, call: &Call, address: &mut Addresses<'_>) -> Result<(), KernelError> {
    let mut addresses = Vec::with_capacity(call.buffers.len());
    for (uid, buffer) in &call.buffers {
        addresses.push((*uid, address(buffer)?));
    }
    let workspace = address(&call.workspace)?;
    let zeroed = match &call.zeroed {
        Some((buffer, bytes)) => Some((address(buffer)?, *bytes)),
        None => None,
    };
    cudnn::with_device(call.key.device, |dev| {
        let own_stream = dev.stream;
        cuda_stream::ordered(order, dev, own_stream, |dev, stream| {
            if let Some((ptr, bytes)) = zeroed {
                // SAFETY: a live buffer of `bytes` bytes (held until the
                // call is enqueued).
                unsafe { drv::memset_d8_async(ptr, 0, bytes, stream) }
                    .map_err(|e| KernelError::Launch(format!("cuMemsetD8Async: {e:?}")))?;
            }
            let plans = PLANS.lock().unwrap_or_else(|p| p.into_inner());
            let plan = match plans.get(&call.key) {
                Some(Ok(plan)) => plan,
                _ => {
                    return Err(KernelError::Launch(
                        "cuDNN attention plan missing at launch".into(),
                    ));
                }
            };
            // SAFETY: the buffers are live CubeCL buffers (held until the
            // call is enqueued) that `check` found large enough for the
            // graph's tensors; the workspace holds the plan's bytes;
            // `ordered` orders the call against CubeCL's stream.
            unsafe { plan.execute(dev.handle, stream, &addresses, &call.scalars, workspace) }
        })
    })
}
