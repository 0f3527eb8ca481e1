//! Attention's composite reference: plain Burn ops, the probabilities
//! materialized in f32.

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Bool, DType, Int, Tensor, TensorMetadata};

use super::{AttentionGrads, AttentionSpec, AttentionTensors};

/// One call's tensors on `B`.
type Tensors<B> = AttentionTensors<FloatTensor<B>, IntTensor<B>>;
use crate::ops::float;

/// `[batch, 1, seq_q, seq_k]`, `true` where a key is hidden from a query.
fn hidden_keys<B: Backend>(
    dims: [usize; 3],
    key_lengths: Option<IntTensor<B>>,
    doc_starts: Option<IntTensor<B>>,
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
            .clone()
            .reshape([1, 1, 1, sk])
            .expand([b, 1, 1, sk])
            .greater_equal(lengths.expand([b, 1, 1, sk]))
            .expand([b, 1, sq, sk]);
        mask4 = Some(match mask4 {
            Some(m) => m.bool_or(pad),
            None => pad,
        });
    }
    if let Some(starts) = doc_starts {
        // Keys before the query's document start (the causal mask hides
        // those after its end).
        let query_starts = Tensor::<B, 2, Int>::from_primitive(starts)
            .narrow(1, offset as usize, sq)
            .reshape([b, 1, sq, 1]);
        let other = keys
            .reshape([1, 1, 1, sk])
            .expand([b, 1, sq, sk])
            .lower(query_starts.expand([b, 1, sq, sk]));
        mask4 = Some(match mask4 {
            Some(m) => m.bool_or(other),
            None => other,
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
    doc_starts: Option<IntTensor<B>>,
    spec: &AttentionSpec,
) -> Probs<B> {
    let [b, h, sq, _] = q.dims();
    let sk = k.dims()[2];
    let device = q.device();
    // The product in the input dtype, the softmax in f32: HF's eager
    // attention.
    let k = repeat_heads(k.clone(), h);
    let mut scores = q.clone().matmul(k.swap_dims(2, 3)).cast(DType::F32) * spec.scale;
    if let Some(mask) = hidden_keys::<B>([b, sq, sk], key_lengths, doc_starts, spec, &device) {
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
    t: Tensors<B>,
    spec: AttentionSpec,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let AttentionTensors {
        q,
        k,
        v,
        sinks,
        key_lengths,
        doc_starts,
    } = t;
    let (q, k, v) = (float::<B, 4>(q), float::<B, 4>(k), float::<B, 4>(v));
    let dtype = q.dtype();
    let h = q.dims()[1];
    let pr = probs(&q, &k, sinks, key_lengths, doc_starts, &spec);
    let out = pr.p.cast(dtype).matmul(repeat_heads(v, h));
    (
        out.into_primitive().tensor(),
        pr.lse.into_primitive().tensor(),
    )
}

/// Reference backward with plain Burn ops (probabilities recomputed in
/// f32): the gradients for the output gradient `dout`.
pub fn composite_backward<B: Backend>(
    t: Tensors<B>,
    out: FloatTensor<B>,
    dout: FloatTensor<B>,
    spec: AttentionSpec,
) -> AttentionGrads<FloatTensor<B>> {
    let AttentionTensors {
        q,
        k,
        v,
        sinks,
        key_lengths,
        doc_starts,
    } = t;
    let (q, k, v) = (float::<B, 4>(q), float::<B, 4>(k), float::<B, 4>(v));
    let (dtype, kv_heads) = (q.dtype(), k.dims()[1]);
    let sink_dtype = sinks.as_ref().map(|s| s.dtype());
    let h = q.dims()[1];
    let pr = probs(&q, &k, sinks, key_lengths, doc_starts, &spec);
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
