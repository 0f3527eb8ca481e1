//! Attention for training: the checked public entry point, the composite
//! reference (forward and an explicit backward), and the autodiff node of
//! the fused op.
//!
//! Semantics, per batch entry and query head `h` (key/value head
//! `h / (heads / kv_heads)`, GQA with no materialized repeat):
//! `softmax(scale · q·kᵀ + mask)·v`, where the mask hides keys past the
//! batch entry's `key_length`, keys after the query when causal, and keys
//! `window` or more positions back with a sliding window; queries are
//! bottom-right aligned with the keys (query `i` sits at key position
//! `i + seq_k − seq_q`), as Burn's causal attention. With sinks, the softmax
//! has one more logit per head (`sinks[h]`) that carries no value (GPT-OSS).
//! A row that sees no key and has no sink outputs zeros. Scores and
//! softmax are f32; the output has the input dtype.
//!
//! The fused path saves only the output and an f32 log-sum-exp per row and
//! recomputes the scores block by block in the backward pass: memory is
//! linear in the sequence length.

use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::{FloatTensor, IntTensor};
use core::sync::atomic::{AtomicU64, Ordering};

use burn::tensor::{Bool, DType, Distribution, Int, Shape, Tensor, TensorMetadata};
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};

use crate::ops::{check_float, check_same_device, float};
use crate::{BastileBackend, BastileError};

/// Score-matrix size (`batch · heads · seq_q · seq_k` elements) from which
/// `Bastile<B>` runs the tiled attention kernels; below it, the composite
/// path.
///
/// The tiled kernels are the portable shared-memory path (f32 FMA): on an
/// H100 they are slower than the composite's matrix products but keep
/// memory linear in the sequence (475 MiB against 25.8 GB for one
/// Qwen3-sized layer at 8192 tokens). The default, 2²⁷ elements (512 MiB
/// of f32 scores per call, e.g. 16 heads at 4096 tokens), takes them where
/// the composite's saved scores start to decide whether a model fits. The
/// matrix-product path (see [`AttentionKernels`]) is faster than the
/// composite at every size measured and runs whatever the size, and so do
/// the tensor-core kernels.
pub const DEFAULT_FUSED_FROM: u64 = 1 << 27;

static FUSED_FROM: AtomicU64 = AtomicU64::new(DEFAULT_FUSED_FROM);

/// Sets the score-matrix size from which the tiled attention kernels run
/// (0: always, `u64::MAX`: never; see [`DEFAULT_FUSED_FROM`]).
pub fn set_fused_from(score_elements: u64) {
    FUSED_FROM.store(score_elements, Ordering::SeqCst);
}

/// Whether a call with query and key shapes `dims` takes the fused path:
/// always on the tensor-core and matrix-product paths (`always`), from the
/// size set by [`set_fused_from`] on the tiled kernels.
pub fn worth_fusing(dims: &[Shape; 2], always: bool) -> bool {
    let [q, k] = dims;
    if q.num_dims() != 4 || k.num_dims() != 4 {
        return false;
    }
    let elements = (q[0] * q[1]) as u64 * (q[2] * k[2]) as u64;
    always || elements >= FUSED_FROM.load(Ordering::SeqCst)
}

/// Which kernels the fused attention runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionKernels {
    /// The tensor-core kernels where the runtime has them (CUDA, f16 and
    /// bf16, head dims that are multiples of 16); else matrix products
    /// where the `matmul` patch runs them on cuBLASLt; else the tiled
    /// kernels.
    #[default]
    Auto,
    /// The tiled flash-style kernels (shared-memory tiles, f32 FMA) on
    /// every runtime.
    Tiled,
    /// Blocks of query rows through matrix products and row kernels on
    /// every runtime (the runtime's own matmul where cuBLASLt is absent),
    /// at most `block_rows` query rows per block; 0 sizes the blocks from
    /// [`BLOCK_SCORES`].
    MatrixProducts { block_rows: usize },
}

/// Score elements (`batch · heads · rows · keys`) one block of the
/// matrix-product path may hold: 2²⁶, i.e. 256 MiB of f32 scores, plus the
/// same again for their gradient and two half-size matrices in the
/// backward. Constant in the sequence length, so memory stays linear in it.
pub const BLOCK_SCORES: usize = 1 << 26;

/// 0: auto, 1: tiled, n ≥ 2: matrix products with `n − 2` block rows.
static KERNELS: AtomicU64 = AtomicU64::new(0);

/// Chooses the attention kernels (see [`AttentionKernels`]); process-wide,
/// read at every call.
pub fn set_attention_kernels(kernels: AttentionKernels) {
    let code = match kernels {
        AttentionKernels::Auto => 0,
        AttentionKernels::Tiled => 1,
        AttentionKernels::MatrixProducts { block_rows } => 2 + block_rows as u64,
    };
    KERNELS.store(code, Ordering::SeqCst);
}

/// The attention kernels in use (see [`set_attention_kernels`]).
pub fn attention_kernels() -> AttentionKernels {
    match KERNELS.load(Ordering::SeqCst) {
        0 => AttentionKernels::Auto,
        1 => AttentionKernels::Tiled,
        n => AttentionKernels::MatrixProducts {
            block_rows: (n - 2) as usize,
        },
    }
}

/// Query rows per block of the matrix-product path for `batch · heads`
/// score matrices of `seq_k` keys: the configured count, or as many as
/// [`BLOCK_SCORES`] allows, a multiple of 64 (at least 16).
pub(crate) fn block_rows(matrices: usize, seq_k: usize) -> usize {
    match attention_kernels() {
        AttentionKernels::MatrixProducts { block_rows } if block_rows > 0 => block_rows,
        _ => {
            let rows = BLOCK_SCORES / (matrices * seq_k).max(1);
            if rows >= 64 {
                rows / 64 * 64
            } else {
                rows.max(16)
            }
        }
    }
}

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

/// The resolved options the backend methods take.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionSpec {
    pub scale: f64,
    pub causal: bool,
    pub window: Option<usize>,
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

/// Attention of `q` `[batch, heads, seq_q, head_dim]` over `k` and `v`
/// `[batch, kv_heads, seq_k, head_dim]` (any strides: a sequence-major
/// projection viewed with `swap_dims(1, 2)` is read in place).
///
/// * `sinks`: `[heads]`, one extra softmax logit per head, learned.
/// * `key_lengths`: `[batch]`, how many leading keys of each batch entry are
///   real (right padding); the rest are hidden.
///
/// Errors on ranks/shapes that do not fit together, a head count not a
/// multiple of the key/value heads, a zero window, a non-finite or
/// non-positive scale, non-float inputs, or tensors on different devices.
///
/// # Shapes
///
/// - `q`: `[batch, heads, seq_q, head_dim]`
/// - `k`, `v`: `[batch, kv_heads, seq_k, head_dim]`, `heads` a multiple of `kv_heads`
/// - `sinks`: `[heads]`; `key_lengths`: `[batch]`
/// - output: `[batch, heads, seq_q, head_dim]`
pub fn attention<B: BastileBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    sinks: Option<Tensor<B, 1>>,
    key_lengths: Option<Tensor<B, 1, Int>>,
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
    };
    Ok(float(B::flash_attention(
        q.into_primitive().tensor(),
        k.into_primitive().tensor(),
        v.into_primitive().tensor(),
        sinks.map(|s| s.into_primitive().tensor()),
        key_lengths.map(|l| l.into_primitive()),
        spec,
    )))
}

/// `[batch, 1, seq_q, seq_k]`, `true` where a key is hidden from a query.
fn hidden_keys<B: Backend>(
    dims: [usize; 3],
    key_lengths: Option<IntTensor<B>>,
    spec: &AttentionSpec,
    device: &B::Device,
) -> Option<Tensor<B, 4, Bool>> {
    let [b, sq, sk] = dims;
    let keys = Tensor::<B, 1, Int>::arange(0..sk as i64, device);
    let offset = sk as i64 - sq as i64;
    let pos = Tensor::<B, 1, Int>::arange(offset..offset + sq as i64, device).reshape([sq, 1]);
    let k2 = keys.clone().reshape([1, sk]);
    let mut mask: Option<Tensor<B, 2, Bool>> = None;
    if spec.causal {
        mask = Some(k2.clone().greater(pos.clone()));
    }
    if let Some(w) = spec.window {
        let far = k2.lower_equal(pos.sub_scalar(w as i64));
        mask = Some(match mask {
            Some(m) => m.bool_or(far),
            None => far,
        });
    }
    let mut mask4 = mask.map(|m| m.reshape([1, 1, sq, sk]).expand([b, 1, sq, sk]));
    if let Some(lengths) = key_lengths {
        let lengths = Tensor::<B, 1, Int>::from_primitive(lengths).reshape([b, 1, 1, 1]);
        let pad = keys
            .reshape([1, 1, 1, sk])
            .expand([b, 1, 1, sk])
            .greater_equal(lengths.expand([b, 1, 1, sk]))
            .expand([b, 1, sq, sk]);
        mask4 = Some(match mask4 {
            Some(m) => m.bool_or(pad),
            None => pad,
        });
    }
    mask4
}

/// `k` or `v` `[b, hkv, s, d]` repeated to `[b, heads, s, d]`.
fn repeat_heads<B: Backend>(t: Tensor<B, 4>, heads: usize) -> Tensor<B, 4> {
    let [b, hk, s, d] = t.dims();
    let rep = heads / hk;
    if rep == 1 {
        return t;
    }
    t.unsqueeze_dim::<5>(2)
        .expand([b, hk, rep, s, d])
        .reshape([b, heads, s, d])
}

/// `[b, heads, s, d]` summed back over each group to `[b, hkv, s, d]`.
fn sum_groups<B: Backend>(t: Tensor<B, 4>, kv_heads: usize) -> Tensor<B, 4> {
    let [b, h, s, d] = t.dims();
    let rep = h / kv_heads;
    if rep == 1 {
        return t;
    }
    t.reshape([b, kv_heads, rep, s, d])
        .sum_dim(2)
        .reshape([b, kv_heads, s, d])
}

/// f32 softmax probabilities `[b, h, sq, sk]`, the sink's `[b, h, sq, 1]`
/// (zeros without sinks) and the log-sum-exp `[b, h, sq]`.
struct Probs<B: Backend> {
    p: Tensor<B, 4>,
    sink: Tensor<B, 4>,
    lse: Tensor<B, 3>,
}

fn probs<B: Backend>(
    q: &Tensor<B, 4>,
    k: &Tensor<B, 4>,
    sinks: Option<FloatTensor<B>>,
    key_lengths: Option<IntTensor<B>>,
    spec: &AttentionSpec,
) -> Probs<B> {
    let [b, h, sq, _] = q.dims();
    let sk = k.dims()[2];
    let device = q.device();
    // The product in the input dtype, the softmax in f32: HF's eager
    // attention.
    let k = repeat_heads(k.clone(), h);
    let mut scores = q.clone().matmul(k.swap_dims(2, 3)).cast(DType::F32) * spec.scale;
    if let Some(mask) = hidden_keys::<B>([b, sq, sk], key_lengths, spec, &device) {
        scores = scores.mask_fill(mask.expand([b, h, sq, sk]), f32::NEG_INFINITY);
    }
    // Max over the keys and the sink; a row that sees nothing keeps a
    // finite max so that it yields zeros, not NaN.
    let mut max = scores.clone().max_dim(3);
    let sink = sinks.map(|s| {
        float::<B, 1>(s)
            .cast(DType::F32)
            .reshape([1, h, 1, 1])
            .expand([b, h, sq, 1])
    });
    if let Some(s) = &sink {
        max = max.max_pair(s.clone());
    }
    let max = max.clamp_min(f32::MIN);
    let e = (scores - max.clone()).exp();
    let es = sink.map(|s| (s - max.clone()).exp());
    let mut total = e.clone().sum_dim(3);
    if let Some(es) = &es {
        total = total + es.clone();
    }
    let total = total.clamp_min(f32::MIN_POSITIVE);
    let lse = (max + total.clone().log()).reshape([b, h, sq]);
    Probs {
        p: e / total.clone(),
        sink: match es {
            Some(es) => es / total,
            None => Tensor::zeros([b, h, sq, 1], &device),
        },
        lse,
    }
}

/// Reference forward with plain Burn ops: `(out, lse)`, `lse` f32
/// `[batch, heads, seq_q]`.
pub fn composite_forward<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    sinks: Option<FloatTensor<B>>,
    key_lengths: Option<IntTensor<B>>,
    spec: AttentionSpec,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let (q, k, v) = (float::<B, 4>(q), float::<B, 4>(k), float::<B, 4>(v));
    let dtype = q.dtype();
    let h = q.dims()[1];
    let pr = probs(&q, &k, sinks, key_lengths, &spec);
    let out = pr.p.cast(dtype).matmul(repeat_heads(v, h));
    (
        out.into_primitive().tensor(),
        pr.lse.into_primitive().tensor(),
    )
}

/// Reference backward with plain Burn ops (probabilities recomputed in
/// f32): the gradients for the output gradient `dout`.
#[allow(clippy::too_many_arguments)]
pub fn composite_backward<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    out: FloatTensor<B>,
    dout: FloatTensor<B>,
    sinks: Option<FloatTensor<B>>,
    key_lengths: Option<IntTensor<B>>,
    spec: AttentionSpec,
) -> AttentionGrads<FloatTensor<B>> {
    let (q, k, v) = (float::<B, 4>(q), float::<B, 4>(k), float::<B, 4>(v));
    let (dtype, kv_heads) = (q.dtype(), k.dims()[1]);
    let sink_dtype = sinks.as_ref().map(|s| s.dtype());
    let h = q.dims()[1];
    let pr = probs(&q, &k, sinks, key_lengths, &spec);
    let f = |t: Tensor<B, 4>| t.cast(DType::F32);
    let dout = f(float::<B, 4>(dout));
    let delta = (f(float::<B, 4>(out)) * dout.clone()).sum_dim(3);
    let (kx, vx) = (f(repeat_heads(k, h)), f(repeat_heads(v, h)));
    let dp = dout.clone().matmul(vx.swap_dims(2, 3));
    let ds = pr.p.clone() * (dp - delta.clone()) * spec.scale;
    let dq = ds.clone().matmul(kx);
    let dk = ds.swap_dims(2, 3).matmul(f(q));
    let dv = pr.p.swap_dims(2, 3).matmul(dout);
    let dsinks = sink_dtype.map(|dt| {
        (pr.sink * delta)
            .neg()
            .sum_dim(0)
            .sum_dim(2)
            .reshape([h])
            .cast(dt)
            .into_primitive()
            .tensor()
    });
    let back = |t: Tensor<B, 4>| t.cast(dtype).into_primitive().tensor();
    AttentionGrads {
        q: back(dq),
        k: back(sum_groups(dk, kv_heads)),
        v: back(sum_groups(dv, kv_heads)),
        sinks: dsinks,
    }
}

/// The inputs of one call, as the backend methods take them.
#[derive(Debug, Clone)]
struct Inputs<B: Backend> {
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    sinks: Option<FloatTensor<B>>,
    key_lengths: Option<IntTensor<B>>,
    spec: AttentionSpec,
}

/// What the backward pass recomputes from: the inputs, the output and the
/// f32 log-sum-exp.
#[derive(Debug, Clone)]
struct Saved<B: Backend> {
    inputs: Inputs<B>,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
}

#[derive(Debug)]
struct AttentionBackward<const P: usize>;

impl<B: BastileBackend, const P: usize> Backward<B, P> for AttentionBackward<P> {
    type State = Saved<B>;

    fn backward(
        self,
        ops: Ops<Self::State, P>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let dout = grads.consume::<B>(&ops.node);
        let Saved {
            inputs: i,
            out,
            lse,
        } = ops.state;
        let g = B::attention_backward(
            i.q,
            i.k,
            i.v,
            out,
            lse,
            dout,
            i.sinks,
            i.key_lengths,
            i.spec,
        );
        let all = [Some(g.q), Some(g.k), Some(g.v), g.sinks];
        for (node, g) in ops.parents.into_iter().zip(all) {
            if let (Some(node), Some(g)) = (node, g) {
                grads.register::<B>(node.id, g);
            }
        }
    }
}

fn node<B: BastileBackend, C: CheckpointStrategy, const P: usize>(
    parents: [&FloatTensor<Autodiff<B, C>>; P],
    i: Inputs<B>,
) -> FloatTensor<Autodiff<B, C>> {
    let parents = parents.map(|t| t.node.clone());
    match AttentionBackward::<P>
        .prepare::<C>(parents)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (out, lse) = B::attention_forward(
                i.q.clone(),
                i.k.clone(),
                i.v.clone(),
                i.sinks.clone(),
                i.key_lengths.clone(),
                i.spec,
            );
            let saved = Saved {
                inputs: i,
                out: out.clone(),
                lse,
            };
            prep.finish(saved, out)
        }
        OpsKind::UnTracked(prep) => prep.finish(B::flash_attention(
            i.q,
            i.k,
            i.v,
            i.sinks,
            i.key_lengths,
            i.spec,
        )),
    }
}

/// `Autodiff<B>`'s attention: one node saving the inputs, the output and
/// the f32 log-sum-exp, whose backward is `B`'s; the composite graph when
/// `B` does not fuse it.
pub(crate) fn autodiff<B: BastileBackend, C: CheckpointStrategy>(
    q: FloatTensor<Autodiff<B, C>>,
    k: FloatTensor<Autodiff<B, C>>,
    v: FloatTensor<Autodiff<B, C>>,
    sinks: Option<FloatTensor<Autodiff<B, C>>>,
    key_lengths: Option<IntTensor<B>>,
    spec: AttentionSpec,
) -> FloatTensor<Autodiff<B, C>> {
    let device = B::float_device(&q.primitive);
    let dims = [q.primitive.shape(), k.primitive.shape()];
    if !B::attention_fused(&device, &dims, q.primitive.dtype(), &spec) {
        let lengths = key_lengths.map(<Autodiff<B, C> as AutodiffBackend>::int_from_inner);
        let (out, _) = composite_forward::<Autodiff<B, C>>(q, k, v, sinks, lengths, spec);
        return out;
    }
    let inputs = Inputs {
        q: q.primitive.clone(),
        k: k.primitive.clone(),
        v: v.primitive.clone(),
        sinks: sinks.as_ref().map(|s| s.primitive.clone()),
        key_lengths,
        spec,
    };
    match &sinks {
        Some(s) => node::<B, C, 4>([&q, &k, &v, s], inputs),
        None => node::<B, C, 3>([&q, &k, &v], inputs),
    }
}

/// Compiles (and autotunes) the attention kernels for a small causal GQA
/// problem with sinks.
pub(crate) fn warmup<B: BastileBackend>(device: &B::Device) {
    let normal = Distribution::Normal(0.0, 1.0);
    let q = Tensor::<B, 4>::random([1, 4, 128, 64], normal, device);
    let k = Tensor::<B, 4>::random([1, 2, 128, 64], normal, device);
    let v = Tensor::<B, 4>::random([1, 2, 128, 64], normal, device);
    let options = AttentionOptions {
        causal: true,
        ..Default::default()
    };
    let _ = attention(q, k, v, None, None, options);
    let _ = B::sync(device);
}
