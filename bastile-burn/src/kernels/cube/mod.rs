//! Direct launches on `CubeBackend`: lay the inputs out as the kernels take
//! them (copying only when their strides do not allow it), allocate the
//! outputs, run the autotuned kernel. One file per op.

mod adamw;
mod attention;
mod attention_products;
mod cross_entropy;
mod geglu;
mod linear_cross_entropy;
mod matmul;
mod rms_norm;
mod rope;
mod swiglu;

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Device, Shape, TensorMetadata};
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use bastile_cubecl::launch::gcd;
use bastile_cubecl::rows::Rows;

use super::{KernelBackend, kernel_dtype};
use crate::RmsNormCast;
use crate::ops::adamw::{AdamWStep, AdamWTensors};
use crate::ops::attention::{AttentionGrads, AttentionSpec};
use crate::ops::cross_entropy::LossSpec;
use crate::ops::linear_cross_entropy::LinearGrads;
use crate::ops::rope::RopeOptions;
use crate::ops::swiglu::GluTensors;
use linear_cross_entropy::Pass;

/// `(rows, row stride)` when the tensor is a stack of unit-stride rows of
/// its last dimension, evenly spaced (CubeCL's optimized layouts pad the
/// row pitch, so the stride can exceed the row length).
fn row_layout(shape: &Shape, strides: &[usize]) -> Option<(usize, usize)> {
    let d = shape.num_dims();
    let hidden = shape[d - 1];
    if hidden > 1 && strides[d - 1] != 1 {
        return None;
    }
    let rows = shape.num_elements() / hidden.max(1);
    let mut pitch = None;
    let mut expected = 0;
    for i in (0..d - 1).rev().filter(|&i| shape[i] > 1) {
        match pitch {
            None => {
                pitch = Some(strides[i]);
                expected = strides[i] * shape[i];
            }
            Some(_) if strides[i] != expected => return None,
            Some(_) => expected *= shape[i],
        }
    }
    let pitch = pitch.unwrap_or(hidden);
    (pitch >= hidden).then_some((rows, pitch))
}

/// The row alignment (in elements) the kernels are promised: 16 bytes, or
/// less when `hidden` itself is not a multiple of that.
fn row_alignment(hidden: usize, elem_size: usize) -> usize {
    gcd(hidden, 16 / elem_size)
}

/// Where the tensor's data starts in its buffer, in elements (views made
/// by slicing start past the beginning).
fn offset_elems<R: CubeRuntime>(t: &CubeTensor<R>) -> usize {
    t.handle.offset_start.unwrap_or(0) as usize / t.dtype.size()
}

/// The tensor as evenly spaced, aligned rows; copied into a fresh layout
/// only when its strides or start do not allow that.
fn as_rows<R: CubeRuntime>(t: CubeTensor<R>) -> (CubeTensor<R>, Rows) {
    let shape = t.shape();
    let align = row_alignment(*shape.last().expect("rank >= 1"), t.dtype.size());
    let aligned = |t: &CubeTensor<R>| {
        row_layout(&t.shape(), t.meta.strides())
            .filter(|&(_, stride)| stride.is_multiple_of(align))
            .filter(|_| offset_elems(t).is_multiple_of(align))
    };
    let t = if aligned(&t).is_some() {
        t
    } else {
        into_contiguous(t)
    };
    let (_, stride) = aligned(&t).expect("a contiguous copy is aligned, evenly spaced rows");
    let rows = Rows {
        handle: t.handle.clone(),
        stride,
    };
    (t, rows)
}

/// `(rows, row length)` of a tensor seen as rows of its last dimension.
fn rows_cols(shape: &Shape) -> (usize, usize) {
    let cols = *shape.last().expect("validated rank >= 1");
    (shape.num_elements() / cols.max(1), cols)
}

/// The gcd of `width` and every row stride: bounds the vector width.
fn stride_multiple(width: usize, rows: &[&Rows]) -> usize {
    rows.iter().fold(width, |g, r| gcd(g, r.stride))
}

/// An int tensor (labels, key lengths) as contiguous i32, what the kernels
/// read.
fn contiguous_i32<R: CubeRuntime>(ints: CubeTensor<R>) -> CubeTensor<R> {
    let ints = if ints.dtype == DType::I32 {
        ints
    } else {
        cast(ints, DType::I32)
    };
    into_contiguous(ints)
}

fn empty_like<R: CubeRuntime>(x: &CubeTensor<R>, shape: Shape, dtype: DType) -> CubeTensor<R> {
    empty_device_dtype(x.client.clone(), x.device.clone(), shape, dtype)
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> KernelBackend
    for CubeBackend<R, F, I, BT>
{
    fn rms_norm_supported(device: &Device<Self>, hidden: usize, dtype: DType) -> bool {
        rms_norm::supported::<R>(device, hidden, dtype)
    }

    fn rms_norm_forward_kernel(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        eps: f64,
        cast: RmsNormCast,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        rms_norm::forward(x, gamma, eps, cast)
    }

    fn rms_norm_backward_kernel(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        cast: RmsNormCast,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        rms_norm::backward(x, gamma, rstd, dy, cast)
    }

    fn elementwise_supported(device: &Device<Self>, dtype: DType) -> bool {
        kernel_dtype(dtype)
            .is_some_and(|d| R::client(device).properties().supports_type(d.storage()))
    }

    fn swiglu_forward_kernel(input: GluTensors<FloatTensor<Self>>) -> FloatTensor<Self> {
        swiglu::forward(input)
    }

    fn swiglu_backward_kernel(
        input: GluTensors<FloatTensor<Self>>,
        dout: FloatTensor<Self>,
    ) -> GluTensors<FloatTensor<Self>> {
        swiglu::backward(input, dout)
    }

    fn geglu_forward_kernel(x: FloatTensor<Self>, alpha: f64, limit: f64) -> FloatTensor<Self> {
        geglu::forward(x, alpha, limit)
    }

    fn geglu_backward_kernel(
        x: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        alpha: f64,
        limit: f64,
    ) -> FloatTensor<Self> {
        geglu::backward(x, dout, alpha, limit)
    }

    fn rope_kernel(
        q: FloatTensor<Self>,
        k: Option<FloatTensor<Self>>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        options: RopeOptions,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        rope::rope(q, k, cos, sin, options)
    }

    fn matmul_supported(device: &Device<Self>, dtype: DType) -> bool {
        matmul::supported::<R>(device, dtype)
    }

    fn matmul_kernel(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        matmul::matmul::<R, F, I, BT>(lhs, rhs, bias)
    }

    fn cross_entropy_supported(device: &Device<Self>, dtype: DType) -> bool {
        cross_entropy::supported::<R>(device, dtype)
    }

    fn cross_entropy_kernel(
        logits: FloatTensor<Self>,
        labels: IntTensor<Self>,
        spec: LossSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        cross_entropy::forward(logits, labels, &spec)
    }

    fn cross_entropy_grad_kernel(
        logits: FloatTensor<Self>,
        labels: IntTensor<Self>,
        lse: FloatTensor<Self>,
        dloss: FloatTensor<Self>,
        spec: LossSpec,
    ) -> FloatTensor<Self> {
        cross_entropy::backward(logits, labels, lse, dloss, &spec)
    }

    fn linear_cross_entropy_kernel(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        labels: IntTensor<Self>,
        spec: LossSpec,
        grads: bool,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        Option<LinearGrads<FloatTensor<Self>>>,
    ) {
        let pass = if grads {
            Pass::StatsAndGrads
        } else {
            Pass::Stats
        };
        let (stats, grads) =
            linear_cross_entropy::run::<R, F, I, BT>(hidden, weight, bias, labels, &spec, pass);
        let (losses, lse) = stats.expect("a stats pass returns losses");
        (losses, lse, grads)
    }

    fn linear_cross_entropy_backward_kernel(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        labels: IntTensor<Self>,
        lse: FloatTensor<Self>,
        dloss: FloatTensor<Self>,
        spec: LossSpec,
    ) -> LinearGrads<FloatTensor<Self>> {
        let pass = Pass::Grads { lse, dloss };
        linear_cross_entropy::run::<R, F, I, BT>(hidden, weight, bias, labels, &spec, pass)
            .1
            .expect("a gradient pass returns gradients")
    }

    fn attention_always_fused(device: &Device<Self>, dtype: DType) -> bool {
        attention::always_fused::<R>(device, dtype)
    }

    fn attention_supported(
        device: &Device<Self>,
        dims: &[Shape; 2],
        dtype: DType,
        spec: &AttentionSpec,
    ) -> bool {
        attention::supported::<R>(device, dims, dtype, spec)
    }

    fn attention_forward_kernel(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        sinks: Option<FloatTensor<Self>>,
        key_lengths: Option<IntTensor<Self>>,
        spec: AttentionSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        if attention::by_products::<R>(&q.device, q.dtype) {
            attention_products::forward::<R, F, I, BT>(q, k, v, sinks, key_lengths, spec)
        } else {
            attention::forward(q, k, v, sinks, key_lengths, spec)
        }
    }

    fn attention_backward_kernel(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        sinks: Option<FloatTensor<Self>>,
        key_lengths: Option<IntTensor<Self>>,
        spec: AttentionSpec,
    ) -> AttentionGrads<FloatTensor<Self>> {
        if attention::by_products::<R>(&q.device, q.dtype) {
            attention_products::backward::<R, F, I, BT>(
                q,
                k,
                v,
                out,
                lse,
                dout,
                sinks,
                key_lengths,
                spec,
            )
        } else {
            attention::backward(q, k, v, out, lse, dout, sinks, key_lengths, spec)
        }
    }

    fn adamw_clip_kernel(
        grads: Vec<FloatTensor<Self>>,
        max_norm: Option<f64>,
    ) -> FloatTensor<Self> {
        adamw::clip(grads, max_norm)
    }

    fn adamw_update_kernel(
        params: Vec<AdamWTensors<FloatTensor<Self>>>,
        grads: Vec<FloatTensor<Self>>,
        clip: Option<FloatTensor<Self>>,
        hyper: AdamWStep,
    ) -> Vec<AdamWTensors<FloatTensor<Self>>> {
        adamw::update(params, grads, clip, hyper)
    }
}
