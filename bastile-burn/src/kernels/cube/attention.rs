//! Attention on `CubeBackend`: any batch/head/row strides, read in place.

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;

use bastile_cubecl::attention::{
    self, AttentionBackwardBuffers, AttentionForwardBuffers, AttentionProblem, HeadLayout,
};

use super::contiguous_i32;
use crate::kernels::kernel_dtype;
use crate::ops::attention::{AttentionGrads, AttentionKernels, AttentionSpec, attention_kernels};
use crate::patches::{Op, is_enabled};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;

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
        dtype: kernel_dtype(dtype)?,
    })
}

pub(super) fn supported<R: CubeRuntime>(
    device: &R::Device,
    dims: &[Shape; 2],
    dtype: DType,
    spec: &AttentionSpec,
) -> bool {
    problem(dims, dtype, spec, false, false)
        .is_some_and(|p| attention::supported(&R::client(device), &p))
}

/// Whether calls on `device` in `dtype` run on the tensor-core kernels
/// where the problem allows (`Auto` on a runtime that has them).
fn tensor_cores<R: CubeRuntime>(device: &R::Device, dtype: DType) -> bool {
    attention_kernels() == AttentionKernels::Auto
        && kernel_dtype(dtype).is_some_and(|d| attention::mma::available(&R::client(device), d))
}

/// Whether a call on `device` in `dtype` runs on the matrix-product path
/// (see [`AttentionKernels`]).
pub(super) fn by_products<R: CubeRuntime>(device: &R::Device, dtype: DType) -> bool {
    match attention_kernels() {
        AttentionKernels::Auto => {
            is_enabled(Op::Matmul)
                && super::matmul::supported::<R>(device, dtype)
                && !tensor_cores::<R>(device, dtype)
        }
        AttentionKernels::Tiled => false,
        AttentionKernels::MatrixProducts { .. } => true,
    }
}

/// Whether fused attention on `device` in `dtype` runs on a path faster
/// than the composite at every size: the tensor cores or matrix products.
pub(super) fn always_fused<R: CubeRuntime>(device: &R::Device, dtype: DType) -> bool {
    tensor_cores::<R>(device, dtype) || by_products::<R>(device, dtype)
}

/// The problem of a call whose support was checked before the launch.
pub(super) fn checked_problem<R: CubeRuntime>(
    q: &CubeTensor<R>,
    k: &CubeTensor<R>,
    spec: &AttentionSpec,
    sinks: &Option<CubeTensor<R>>,
    key_lengths: &Option<CubeTensor<R>>,
) -> AttentionProblem {
    let dims = [q.shape(), k.shape()];
    problem(&dims, q.dtype, spec, sinks.is_some(), key_lengths.is_some())
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

fn dense<R: CubeRuntime>(like: &CubeTensor<R>, shape: Shape) -> (CubeTensor<R>, HeadLayout) {
    let t = contiguous(like, shape.clone(), like.dtype);
    let layout = HeadLayout::dense(t.handle.clone(), shape[1], shape[2], shape[3]);
    (t, layout)
}

fn f32_rows<R: CubeRuntime>(like: &CubeTensor<R>, shape: Shape) -> CubeTensor<R> {
    contiguous(like, shape, DType::F32)
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

pub(super) fn forward<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    sinks: Option<CubeTensor<R>>,
    key_lengths: Option<CubeTensor<R>>,
    spec: AttentionSpec,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let problem = checked_problem(&q, &k, &spec, &sinks, &key_lengths);
    let (q, q_l) = heads(q);
    let (_k, k_l) = heads(k);
    let (_v, v_l) = heads(v);
    let (out, out_l) = dense(&q, q.shape());
    let [b, h, sq, _] = q.shape().dims();
    let lse = f32_rows(&q, Shape::new([b, h, sq]));
    let sinks = sinks.map(sinks_f32);
    let lengths = key_lengths.map(contiguous_i32);
    let buffers = AttentionForwardBuffers {
        q: q_l,
        k: k_l,
        v: v_l,
        out: out_l,
        lse: lse.handle.clone(),
        sinks: sinks.as_ref().map(|s| s.handle.clone()),
        key_lengths: lengths.as_ref().map(|l| l.handle.clone()),
    };
    let tiled = || attention::forward(&q.client, &q.device, &problem, &buffers);
    // A problem or layout the tensor cores refuse runs on the tiled kernels.
    if tensor_cores::<R>(&q.device, q.dtype) {
        attention::mma::forward(&q.client, &q.device, &problem, &buffers).or_else(|_| tiled())
    } else {
        tiled()
    }
    .unwrap_or_else(|e| panic!("attention forward launch after a positive support check: {e}"));
    (out, lse)
}

#[allow(clippy::too_many_arguments)]
pub(super) fn backward<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    out: CubeTensor<R>,
    lse: CubeTensor<R>,
    dout: CubeTensor<R>,
    sinks: Option<CubeTensor<R>>,
    key_lengths: Option<CubeTensor<R>>,
    spec: AttentionSpec,
) -> AttentionGrads<CubeTensor<R>> {
    let problem = checked_problem(&q, &k, &spec, &sinks, &key_lengths);
    let (q, q_l) = heads(q);
    let (k, k_l) = heads(k);
    let (_v, v_l) = heads(v);
    let (_out, out_l) = heads(out);
    let (_dout, dout_l) = heads(dout);
    let lse = into_contiguous(lse);
    let (dq, dq_l) = dense(&q, q.shape());
    let (dk, dk_l) = dense(&k, k.shape());
    let (dv, dv_l) = dense(&k, k.shape());
    let [b, h, sq, _] = q.shape().dims();
    let delta = f32_rows(&q, Shape::new([b, h, sq]));
    let dsink_rows = sinks.as_ref().map(|_| f32_rows(&q, Shape::new([b, h, sq])));
    let sinks = sinks.map(sinks_f32);
    let lengths = key_lengths.map(contiguous_i32);
    let buffers = AttentionBackwardBuffers {
        q: q_l,
        k: k_l,
        v: v_l,
        out: out_l,
        dout: dout_l,
        lse: lse.handle.clone(),
        sinks: sinks.as_ref().map(|s| s.handle.clone()),
        key_lengths: lengths.as_ref().map(|l| l.handle.clone()),
        dq: dq_l,
        dk: dk_l,
        dv: dv_l,
        delta: delta.handle.clone(),
        dsink_rows: dsink_rows.as_ref().map(|d| d.handle.clone()),
    };
    let tiled = || attention::backward(&q.client, &q.device, &problem, &buffers);
    if tensor_cores::<R>(&q.device, q.dtype) {
        attention::mma::backward(&q.client, &q.device, &problem, &buffers).or_else(|_| tiled())
    } else {
        tiled()
    }
    .unwrap_or_else(|e| panic!("attention backward launch after a positive support check: {e}"));
    AttentionGrads {
        q: dq,
        k: dk,
        v: dv,
        sinks: dsink_rows,
    }
}
