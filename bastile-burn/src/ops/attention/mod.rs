//! Attention for training: the checked public entry point and the fused
//! ops' declarations; the composite reference (forward and an explicit
//! backward) in `composite.rs`, how a call is planned in `plan.rs`, its
//! autodiff node in `autodiff.rs`, its kernel launches in `kernel.rs`
//! (tiled and tensor-core kernels) and `products.rs` (matrix products).
//!
//! Semantics, per batch entry and query head `h` (key/value head
//! `h / (heads / kv_heads)`, GQA with no materialized repeat):
//! `softmax(scale · q·kᵀ + mask)·v`, where the mask hides keys past the
//! batch entry's `key_length`, keys after the query when causal, and keys
//! `window` or more positions back with a sliding window; queries are
//! bottom-right aligned with the keys (query `i` sits at key position
//! `i + seq_k − seq_q`), as Burn's causal attention; rows that pack several
//! documents (given by each position's place in its document) also hide
//! the keys of every other document. With sinks, the softmax
//! has one more logit per head (`sinks[h]`) that carries no value (GPT-OSS).
//! A row that sees no key and has no sink outputs zeros. Scores and
//! softmax are f32; the output has the input dtype.
//!
//! The fused path saves only the output and an f32 log-sum-exp per row and
//! recomputes the scores block by block in the backward pass: memory is
//! linear in the sequence length.

mod autodiff;
mod composite;
mod kernel;
mod plan;
mod products;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Device, Distribution, Int, Shape, Tensor, TensorMetadata};
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;

use crate::fused::{FusedOp, In, KernelBackend, Out, TensorSpec};
use crate::ops::reduce::{Reduction, reduce_dim_kernel};
use crate::ops::{check_float, check_same_device, float};
use crate::patches::Op;
use crate::{BastileBackend, BastileError};
pub use composite::{composite_backward, composite_forward};
pub use kernel::AttentionQuery;
use kernel::{BackwardLaunch, ForwardLaunch};
pub use plan::{
    AttentionKernels, AttentionPlan, BLOCK_SCORES, DEFAULT_FUSED_FROM, attention_kernels,
    deterministic_attention, set_attention_kernels, set_deterministic_attention, set_fused_from,
};

/// What an attention call does besides its tensors.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AttentionOptions {
    /// The score scale; `1/√head_dim` when `None`.
    pub scale: Option<f64>,
    /// Hide keys after the query.
    pub causal: bool,
    /// Hide keys this many or more positions behind the query.
    pub window: Option<usize>,
}

/// The resolved options the fused ops take.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionSpec {
    pub scale: f64,
    pub causal: bool,
    pub window: Option<usize>,
    /// Rows pack documents (the tensors carry `doc_starts`).
    pub documents: bool,
}

/// The scale a call uses: the given one, or `1/√head_dim`.
pub(crate) fn scale_or_default(scale: Option<f64>, head_dim: usize) -> f64 {
    scale.unwrap_or_else(|| 1.0 / (head_dim as f64).sqrt())
}

/// The gradients of the attention inputs.
#[derive(Clone, Debug)]
pub struct AttentionGrads<T> {
    pub q: T,
    pub k: T,
    pub v: T,
    /// `[heads]`, when the call had sinks.
    pub sinks: Option<T>,
}

/// The tensors of one attention call.
#[derive(Clone, Debug)]
pub struct AttentionTensors<F, I> {
    /// `[batch, heads, seq_q, head_dim]`
    pub q: F,
    /// `[batch, kv_heads, seq_k, head_dim]`
    pub k: F,
    /// `[batch, kv_heads, seq_k, head_dim]`
    pub v: F,
    /// `[heads]`
    pub sinks: Option<F>,
    /// `[batch]`
    pub key_lengths: Option<I>,
    /// `[batch, seq_k]`: where each key position's document starts (never
    /// decreasing along a row, at most the position; [`document_starts`]).
    pub doc_starts: Option<I>,
}

/// Attention of `q` `[batch, heads, seq_q, head_dim]` over `k` and `v`
/// `[batch, kv_heads, seq_k, head_dim]` (any strides: a sequence-major
/// projection viewed with `swap_dims(1, 2)` is read in place).
///
/// * `sinks`: `[heads]`, one extra softmax logit per head, learned.
/// * `key_lengths`: `[batch]`, how many leading keys of each batch entry are
///   real (right padding); the rest are hidden.
/// * `positions`: `[batch, seq_k]`, each key position's place in its
///   document, for rows that pack several documents: a document starts
///   where the position is 0 (and at the row's start), and a query sees
///   only the keys of its own document. The same ids that give RoPE its
///   angles. Needs the causal mask.
///
/// Errors on ranks/shapes that do not fit together, a head count not a
/// multiple of the key/value heads, a zero window, a non-finite or
/// non-positive scale, documents without the causal mask, non-float
/// inputs, or tensors on different devices.
///
/// # Shapes
///
/// - `q`: `[batch, heads, seq_q, head_dim]`
/// - `k`, `v`: `[batch, kv_heads, seq_k, head_dim]`, `heads` a multiple of `kv_heads`
/// - `sinks`: `[heads]`; `key_lengths`: `[batch]`; `positions`: `[batch, seq_k]`
/// - output: `[batch, heads, seq_q, head_dim]`
pub fn attention<B: BastileBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    sinks: Option<Tensor<B, 1>>,
    key_lengths: Option<Tensor<B, 1, Int>>,
    positions: Option<Tensor<B, 2, Int>>,
    options: AttentionOptions,
) -> Result<Tensor<B, 4>, BastileError> {
    for (what, t) in [("query", &q), ("key", &k), ("value", &v)] {
        check_float(&format!("attention {what}"), t.dtype())?;
    }
    let [b, h, sq, d] = q.dims();
    let [kb, hk, sk, kd] = k.dims();
    if v.dims() != k.dims() {
        return Err(BastileError::Shape(format!(
            "attention value shape {:?} differs from key shape {:?}",
            v.dims(),
            k.dims()
        )));
    }
    if kb != b || kd != d || [b, h, sq, d, hk, sk].contains(&0) {
        return Err(BastileError::Shape(format!(
            "attention query {:?} and key {:?} must agree in batch and head dim, and be non-empty",
            q.dims(),
            k.dims()
        )));
    }
    if !h.is_multiple_of(hk) {
        return Err(BastileError::Shape(format!(
            "attention needs the query heads ({h}) to be a multiple of the key/value heads ({hk})"
        )));
    }
    if let Some(s) = &sinks {
        check_float("attention sinks", s.dtype())?;
        if s.dims() != [h] {
            return Err(BastileError::Shape(format!(
                "attention sinks must be [heads] = [{h}], got {:?}",
                s.dims()
            )));
        }
        check_same_device("sinks", &s.device(), "query", &q.device())?;
    }
    if let Some(l) = &key_lengths {
        if l.dims() != [b] {
            return Err(BastileError::Shape(format!(
                "attention key lengths must be [batch] = [{b}], got {:?}",
                l.dims()
            )));
        }
        check_same_device("key lengths", &l.device(), "query", &q.device())?;
    }
    if let Some(p) = &positions {
        if p.dims() != [b, sk] {
            return Err(BastileError::Shape(format!(
                "attention positions must be [batch, seq_k] = [{b}, {sk}], got {:?}",
                p.dims()
            )));
        }
        if !options.causal {
            return Err(BastileError::Config(
                "packed documents need the causal mask (a query's document must end at the query)"
                    .into(),
            ));
        }
        check_same_device("positions", &p.device(), "query", &q.device())?;
    }
    check_same_device("key", &k.device(), "query", &q.device())?;
    check_same_device("value", &v.device(), "query", &q.device())?;
    if options.window == Some(0) {
        return Err(BastileError::Config(
            "an attention window must hold at least one position".into(),
        ));
    }
    let scale = scale_or_default(options.scale, d);
    if !(scale.is_finite() && scale > 0.0) {
        return Err(BastileError::Config(format!(
            "the attention scale must be finite and positive, got {scale}"
        )));
    }
    let spec = AttentionSpec {
        scale,
        causal: options.causal,
        window: options.window,
        documents: positions.is_some(),
    };
    let input = AttentionTensors {
        q: q.into_primitive().tensor(),
        k: k.into_primitive().tensor(),
        v: v.into_primitive().tensor(),
        sinks: sinks.map(|s| s.into_primitive().tensor()),
        key_lengths: key_lengths.map(|l| l.into_primitive()),
        doc_starts: positions.map(|p| document_starts(p).into_primitive()),
    };
    let (out, _lse) = B::run(&Attention { spec }, input);
    Ok(float(out))
}

/// Where each position's document starts, from each position's place in
/// its document (`[batch, seq]`): the last position at or before it whose
/// place is 0 (the row's start if none). Never decreasing along a row,
/// whatever the ids, so the kernels' block bounds hold.
pub fn document_starts<B: Backend>(positions: Tensor<B, 2, Int>) -> Tensor<B, 2, Int> {
    let [b, s] = positions.dims();
    let index = Tensor::<B, 1, Int>::arange(0..s as i64, &positions.device())
        .reshape([1, s])
        .expand([b, s]);
    index.mask_fill(positions.not_equal_elem(0), 0).cummax(1)
}

/// Attention forward: `(out, lse)`, `lse` the f32 log-sum-exp per query
/// row (`[batch, heads, seq_q]`) that the backward pass takes.
#[derive(Clone, Copy, Debug)]
pub struct Attention {
    pub spec: AttentionSpec,
}

/// Attention backward from the forward's tensors, its output and
/// log-sum-exp, and the output gradient: `(tensors, out, lse, dout)`.
#[derive(Clone, Copy, Debug)]
pub struct AttentionBackward {
    pub spec: AttentionSpec,
}

fn problem_of<B: Backend>(
    t: &AttentionTensors<FloatTensor<B>, burn::tensor::ops::IntTensor<B>>,
    spec: AttentionSpec,
) -> (Device<B>, AttentionQuery) {
    let query = AttentionQuery {
        dims: [t.q.shape(), t.k.shape()],
        dtype: t.q.dtype(),
        spec,
    };
    (B::float_device(&t.q), query)
}

impl FusedOp for Attention {
    const PATCH: Option<Op> = Some(Op::Attention);
    type Input<F, I> = AttentionTensors<F, I>;
    type Output<F, I> = (F, F);
    type Problem = AttentionQuery;
    type Plan = AttentionPlan;

    fn problem<B: Backend>(&self, input: &In<Self, B>) -> (Device<B>, AttentionQuery) {
        problem_of::<B>(input, self.spec)
    }

    fn plan<K: KernelBackend>(
        &self,
        device: &Device<K>,
        query: &AttentionQuery,
    ) -> Option<AttentionPlan> {
        plan::plan::<K>(device, query)
    }

    fn composite<B: Backend>(&self, t: In<Self, B>) -> Out<Self, B> {
        composite_forward::<B>(t, self.spec)
    }

    fn kernels<K: KernelBackend>(&self, plan: AttentionPlan, t: In<Self, K>) -> Out<Self, K> {
        let q = t.q.shape();
        let rows = Shape::new([q[0], q[1], q[2]]);
        let outputs = vec![TensorSpec::of(&t.q), TensorSpec::new(rows, DType::F32)];
        let launch = ForwardLaunch {
            spec: self.spec,
            plan,
            has_sinks: t.sinks.is_some(),
        };
        let floats = [t.q, t.k, t.v].into_iter().chain(t.sinks).collect();
        let ints = t.key_lengths.into_iter().chain(t.doc_starts).collect();
        let mut out = K::launch(&launch, floats, ints, outputs);
        let lse = out.pop().expect("lse");
        (out.pop().expect("the attention output"), lse)
    }

    fn autodiff<B: BastileBackend, C: CheckpointStrategy>(
        &self,
        input: In<Self, Autodiff<B, C>>,
    ) -> Out<Self, Autodiff<B, C>> {
        autodiff::forward::<B, C>(self, input)
    }
}

impl FusedOp for AttentionBackward {
    const PATCH: Option<Op> = Some(Op::Attention);
    type Input<F, I> = (AttentionTensors<F, I>, F, F, F);
    type Output<F, I> = AttentionGrads<F>;
    type Problem = AttentionQuery;
    type Plan = AttentionPlan;

    fn problem<B: Backend>(&self, (t, ..): &In<Self, B>) -> (Device<B>, AttentionQuery) {
        problem_of::<B>(t, self.spec)
    }

    fn plan<K: KernelBackend>(
        &self,
        device: &Device<K>,
        query: &AttentionQuery,
    ) -> Option<AttentionPlan> {
        plan::plan::<K>(device, query)
    }

    fn composite<B: Backend>(&self, (t, out, _lse, dout): In<Self, B>) -> Out<Self, B> {
        composite_backward::<B>(t, out, dout, self.spec)
    }

    fn kernels<K: KernelBackend>(&self, plan: AttentionPlan, input: In<Self, K>) -> Out<Self, K> {
        let (t, out, lse, dout) = input;
        let q = t.q.shape();
        let rows = Shape::new([q[0], q[1], q[2]]);
        let mut outputs = vec![
            TensorSpec::of(&t.q),
            TensorSpec::of(&t.k),
            TensorSpec::of(&t.v),
        ];
        let sink_dtype = t.sinks.as_ref().map(|s| s.dtype());
        if sink_dtype.is_some() {
            // The sink gradient comes per query row; summed per head below.
            outputs.push(TensorSpec::new(rows, DType::F32));
        }
        let launch = BackwardLaunch {
            spec: self.spec,
            plan,
            has_sinks: t.sinks.is_some(),
        };
        let floats = [t.q, t.k, t.v, out, lse, dout]
            .into_iter()
            .chain(t.sinks)
            .collect();
        let ints = t.key_lengths.into_iter().chain(t.doc_starts).collect();
        let mut g = K::launch(&launch, floats, ints, outputs);
        let sinks = sink_dtype.map(|dtype| {
            let rows = g.pop().expect("the sink gradient rows");
            let heads = rows.shape()[1];
            let per_head = reduce_dim_kernel::<K>(rows, Reduction::Sum, 0);
            let per_head = reduce_dim_kernel::<K>(per_head, Reduction::Sum, 2);
            float::<K, 3>(per_head)
                .reshape([heads])
                .cast(dtype)
                .into_primitive()
                .tensor()
        });
        let v = g.pop().expect("dv");
        let k = g.pop().expect("dk");
        AttentionGrads {
            q: g.pop().expect("dq"),
            k,
            v,
            sinks,
        }
    }
}

/// Compiles (and autotunes) the attention kernels for a small causal GQA
/// problem.
pub(crate) fn warmup<B: BastileBackend>(device: &B::Device) {
    let normal = Distribution::Normal(0.0, 1.0);
    let q = Tensor::<B, 4>::random([1, 4, 128, 64], normal, device);
    let k = Tensor::<B, 4>::random([1, 2, 128, 64], normal, device);
    let v = Tensor::<B, 4>::random([1, 2, 128, 64], normal, device);
    let options = AttentionOptions {
        causal: true,
        ..Default::default()
    };
    let _ = attention(q, k, v, None, None, None, options);
    let _ = B::sync(device);
}
