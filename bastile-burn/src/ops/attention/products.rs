//! Attention on `CubeBackend` through matrix products: one block of query
//! rows at a time, the products on cuBLASLt where the `matmul` patch runs
//! there (tensor cores, f32 accumulation and f32 scores), the row kernels
//! of [`bastile_cubecl::attention::block_softmax`] in between. See that
//! module for the algorithm; this file lays the blocks out as products.
//!
//! GQA needs no repeat: query heads `[b, h, rows, d]` are viewed as
//! `[b, kv_heads, group, rows, d]` and the key/value range as
//! `[b, kv_heads, 1, keys, d]`, a broadcast the matmul planner reads in
//! place. The backward's key-side products sum over the group and the
//! block's rows in one contraction (`[keys, group·rows]·[group·rows, d]`)
//! and accumulate over blocks in f32.

use std::ops::Range;

use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_backend::Slice;
use burn_cubecl::kernel::{cast, into_contiguous, slice};
use burn_cubecl::ops::numeric::{empty_device_contiguous_dtype, zeros_client};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use bastile_cubecl::attention::{
    self, AttentionBackwardBuffers, AttentionProblem, BlockGradBuffers, BlockSoftmaxBuffers,
    HeadLayout, QueryBlock,
};

use super::kernel::{Forwarded, checked_problem, heads, sinks_f32};
use super::{AttentionGrads, AttentionSpec};
use crate::backend::matmul::matmul_blas;
use crate::fused::cube::{contiguous_i32, view};
use crate::launch_failure::launch;

type Inner<R, F, I, BT> = CubeBackend<R, F, I, BT>;

/// Query-side `[b, h, rows, d]` as `[b, kv_heads, group, rows, d]`.
fn grouped<R: CubeRuntime>(t: &CubeTensor<R>, kv_heads: usize) -> CubeTensor<R> {
    let [b, h, s, d] = t.shape().dims();
    let st = t.meta.strides();
    let g = h / kv_heads;
    view(
        t,
        &[b, kv_heads, g, s, d],
        &[st[0], g * st[1], st[1], st[2], st[3]],
    )
}

/// Key-side `[b, kv_heads, keys, d]` as `[b, kv_heads, 1, keys, d]`, or
/// transposed to `[b, kv_heads, 1, d, keys]`.
fn broadcast<R: CubeRuntime>(t: &CubeTensor<R>, transposed: bool) -> CubeTensor<R> {
    let [b, hk, s, d] = t.shape().dims();
    let st = t.meta.strides();
    if transposed {
        view(t, &[b, hk, 1, d, s], &[st[0], st[1], 0, st[3], st[2]])
    } else {
        view(t, &[b, hk, 1, s, d], &[st[0], st[1], 0, st[2], st[3]])
    }
}

/// A dense `[b, h, rows, x]` matrix as `[b, kv_heads, group·rows, x]`,
/// optionally transposed in its last two dimensions.
fn merged<R: CubeRuntime>(t: &CubeTensor<R>, kv_heads: usize, transposed: bool) -> CubeTensor<R> {
    let [b, h, r, x] = t.shape().dims();
    let rows = h / kv_heads * r;
    if transposed {
        view(
            t,
            &[b, kv_heads, x, rows],
            &[kv_heads * rows * x, rows * x, 1, x],
        )
    } else {
        view(
            t,
            &[b, kv_heads, rows, x],
            &[kv_heads * rows * x, rows * x, x, 1],
        )
    }
}

/// `[b, kv_heads, group, rows, x]` (dense) as `[b, h, rows, x]`.
fn ungrouped<R: CubeRuntime>(t: CubeTensor<R>) -> CubeTensor<R> {
    let [b, hk, g, r, x] = t.shape().dims();
    view(&t, &[b, hk * g, r, x], &[hk * g * r * x, r * x, x, 1])
}

/// `lhs · rhs` written in `out`: on cuBLASLt when the matmul patch runs
/// there, else the inner backend's matmul (in f32 when an f32 result is
/// asked for, so the scores are never rounded to a half type).
fn product<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    lhs: &CubeTensor<R>,
    rhs: &CubeTensor<R>,
    out: DType,
) -> CubeTensor<R> {
    if let Some(t) = matmul_blas(lhs, rhs, out) {
        return t;
    }
    let operand = |t: &CubeTensor<R>| {
        let t = into_contiguous(t.clone());
        if t.dtype == out { t } else { cast(t, out) }
    };
    Inner::<R, F, I, BT>::float_matmul(operand(lhs), operand(rhs))
}

fn dense<R: CubeRuntime>(like: &CubeTensor<R>, shape: &[usize], dtype: DType) -> CubeTensor<R> {
    empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        Shape::from(shape.to_vec()),
        dtype,
    )
}

fn rows<R: CubeRuntime>(t: &CubeTensor<R>, range: Range<usize>) -> CubeTensor<R> {
    let [b, h, _, d] = t.shape().dims();
    slice(t.clone(), &[0..b, 0..h, range, 0..d])
}

/// The blocks of `problem`: at most `block_rows` query rows each.
fn blocks(problem: &AttentionProblem, block_rows: usize) -> Vec<QueryBlock> {
    QueryBlock::split(problem, block_rows)
}

struct Inputs<R: CubeRuntime> {
    problem: AttentionProblem,
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    sinks: Option<CubeTensor<R>>,
    lengths: Option<CubeTensor<R>>,
    doc_starts: Option<CubeTensor<R>>,
}

impl<R: CubeRuntime> Inputs<R> {
    fn new(t: Forwarded<R>, spec: &AttentionSpec) -> Self {
        Self {
            problem: checked_problem(&t, spec),
            q: heads(t.q).0,
            k: heads(t.k).0,
            v: heads(t.v).0,
            sinks: t.sinks.map(sinks_f32),
            lengths: t.key_lengths.map(contiguous_i32),
            doc_starts: t.doc_starts.map(contiguous_i32),
        }
    }

    /// The key/value rows of `block`, as `[b, kv_heads, keys, d]` views.
    fn key_range(&self, block: &QueryBlock) -> (CubeTensor<R>, CubeTensor<R>) {
        let range = block.k_lo..block.k_lo + block.keys;
        (rows(&self.k, range.clone()), rows(&self.v, range))
    }

    /// `[b, h, rows, keys]` f32 products `lhs_blk · key_sideᵀ`.
    fn scores<F: FloatElement, I: IntElement, BT: BoolElement>(
        &self,
        lhs_block: &CubeTensor<R>,
        key_side: &CubeTensor<R>,
    ) -> CubeTensor<R> {
        let hk = self.problem.kv_heads;
        let s = product::<R, F, I, BT>(
            &grouped(lhs_block, hk),
            &broadcast(key_side, true),
            DType::F32,
        );
        ungrouped(s)
    }
}

pub(super) fn forward<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    t: Forwarded<R>,
    spec: AttentionSpec,
    block_rows: usize,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let x = Inputs::new(t, &spec);
    let p = &x.problem;
    let (b, h, hk) = (p.batch, p.heads, p.kv_heads);
    let lse = dense(&x.q, &[b, h, p.seq_q], DType::F32);
    let mut outs = Vec::new();
    for block in blocks(p, block_rows) {
        let (k_r, v_r) = x.key_range(&block);
        let q_b = rows(&x.q, block.q0..block.q0 + block.rows);
        let scores = x.scores::<F, I, BT>(&q_b, &k_r);
        let probs = dense(&x.q, &[b, h, block.rows, block.keys], x.q.dtype);
        let buffers = BlockSoftmaxBuffers {
            scores: scores.handle.clone(),
            probs: probs.handle.clone(),
            lse: lse.handle.clone(),
            sinks: x.sinks.as_ref().map(|s| s.handle.clone()),
            key_lengths: x.lengths.as_ref().map(|l| l.handle.clone()),
            doc_starts: x.doc_starts.as_ref().map(|s| s.handle.clone()),
        };
        launch("attention block softmax", || {
            attention::block_softmax(&x.q.client, p, &block, &buffers)
        });
        let o = product::<R, F, I, BT>(&grouped(&probs, hk), &broadcast(&v_r, false), x.q.dtype);
        outs.push(ungrouped(o));
    }
    let out = if outs.len() == 1 {
        outs.pop().expect("one block")
    } else {
        Inner::<R, F, I, BT>::float_cat(outs, 2)
    };
    (out, lse)
}

/// `acc[.., range, ..] += part` for an f32 `[b, kv_heads, seq_k, d]`
/// accumulator (updated in place when nothing else holds it).
fn accumulate<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    acc: CubeTensor<R>,
    range: Range<usize>,
    part: CubeTensor<R>,
) -> CubeTensor<R> {
    let [b, hk, _, d] = acc.shape().dims();
    let ranges = [0..b, 0..hk, range, 0..d];
    let sum = Inner::<R, F, I, BT>::float_add(slice(acc.clone(), &ranges), part);
    let slices: Vec<Slice> = ranges.into_iter().map(Slice::from).collect();
    Inner::<R, F, I, BT>::float_slice_assign(acc, &slices, sum)
}

pub(super) fn backward<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    t: Forwarded<R>,
    out: CubeTensor<R>,
    lse: CubeTensor<R>,
    dout: CubeTensor<R>,
    spec: AttentionSpec,
    block_rows: usize,
) -> AttentionGrads<CubeTensor<R>> {
    let x = Inputs::new(t, &spec);
    let p = &x.problem;
    let (b, h, hk, d) = (p.batch, p.heads, p.kv_heads, p.head_dim);
    let (out, out_l) = heads(out);
    let (dout, dout_l) = heads(dout);
    let lse = into_contiguous(lse);
    let delta = dense(&x.q, &[b, h, p.seq_q], DType::F32);
    let dsink_rows = x
        .sinks
        .as_ref()
        .map(|_| dense(&x.q, &[b, h, p.seq_q], DType::F32));
    // Only the delta kernel runs: the other layouts are never read.
    let unused = |t: &CubeTensor<R>| HeadLayout::dense(t.handle.clone(), 1, 1, 1);
    let delta_buffers = AttentionBackwardBuffers {
        q: unused(&x.q),
        k: unused(&x.q),
        v: unused(&x.q),
        out: out_l,
        dout: dout_l,
        lse: lse.handle.clone(),
        sinks: x.sinks.as_ref().map(|s| s.handle.clone()),
        key_lengths: None,
        doc_starts: None,
        dq: unused(&x.q),
        dk: unused(&x.q),
        dv: unused(&x.q),
        delta: delta.handle.clone(),
        dsink_rows: dsink_rows.as_ref().map(|t| t.handle.clone()),
    };
    launch("attention delta", || {
        attention::backward_delta(&x.q.client, p, &delta_buffers)
    });
    drop(out);

    let acc_shape = Shape::new([b, hk, p.seq_k, d]);
    let zeros = || {
        zeros_client(
            x.q.client.clone(),
            x.q.device.clone(),
            acc_shape.clone(),
            DType::F32,
        )
    };
    let (mut dk, mut dv) = (zeros(), zeros());
    let mut dqs = Vec::new();
    for block in blocks(p, block_rows) {
        let (k_r, v_r) = x.key_range(&block);
        let q_rows = block.q0..block.q0 + block.rows;
        let q_b = rows(&x.q, q_rows.clone());
        let do_b = rows(&dout, q_rows);
        let scores = x.scores::<F, I, BT>(&q_b, &k_r);
        let dprobs = x.scores::<F, I, BT>(&do_b, &v_r);
        let shape = [b, h, block.rows, block.keys];
        let probs = dense(&x.q, &shape, x.q.dtype);
        let dscores = dense(&x.q, &shape, x.q.dtype);
        let buffers = BlockGradBuffers {
            scores: scores.handle.clone(),
            dprobs: dprobs.handle.clone(),
            lse: lse.handle.clone(),
            delta: delta.handle.clone(),
            key_lengths: x.lengths.as_ref().map(|l| l.handle.clone()),
            doc_starts: x.doc_starts.as_ref().map(|s| s.handle.clone()),
            probs: probs.handle.clone(),
            dscores: dscores.handle.clone(),
        };
        launch("attention block gradient", || {
            attention::block_grad(&x.q.client, p, &block, &buffers)
        });
        drop((scores, dprobs));
        let dq = product::<R, F, I, BT>(&grouped(&dscores, hk), &broadcast(&k_r, false), x.q.dtype);
        dqs.push(ungrouped(dq));
        // Key-side gradients sum over the group's heads and the block's
        // rows: one contraction over `group · rows`.
        let (q_c, do_c) = (into_contiguous(q_b), into_contiguous(do_b));
        let k_range = block.k_lo..block.k_lo + block.keys;
        let dv_part = product::<R, F, I, BT>(
            &merged(&probs, hk, true),
            &merged(&do_c, hk, false),
            DType::F32,
        );
        dv = accumulate::<R, F, I, BT>(dv, k_range.clone(), dv_part);
        let dk_part = product::<R, F, I, BT>(
            &merged(&dscores, hk, true),
            &merged(&q_c, hk, false),
            DType::F32,
        );
        dk = accumulate::<R, F, I, BT>(dk, k_range, dk_part);
    }
    let dq = if dqs.len() == 1 {
        dqs.pop().expect("one block")
    } else {
        Inner::<R, F, I, BT>::float_cat(dqs, 2)
    };
    let to_input = |t: CubeTensor<R>| {
        if t.dtype == x.q.dtype {
            t
        } else {
            cast(t, x.q.dtype)
        }
    };
    AttentionGrads {
        q: dq,
        k: to_input(dk),
        v: to_input(dv),
        sinks: dsink_rows,
    }
}
