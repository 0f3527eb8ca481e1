//! `Fusion<B>`: each fused op is recorded as a custom op in the fusion
//! stream; when the stream runs, the op launches `B`'s kernel on the
//! resolved handles. The surrounding element-wise ops keep fusing around it.

use core::marker::PhantomData;

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Device, Shape};
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{Fusion, FusionBackend, FusionRuntime};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};

use super::KernelBackend;
use crate::RmsNormCast;
use crate::ops::adamw::{AdamWStep, AdamWTensors};
use crate::ops::attention::{AttentionGrads, AttentionSpec};
use crate::ops::cross_entropy::LossSpec;
use crate::ops::linear_cross_entropy::LinearGrads;
use crate::ops::rope::RopeOptions;
use crate::ops::swiglu::GluTensors;

/// What a recorded op runs on `B` once its float and int inputs are
/// resolved.
type Call<B> =
    Box<dyn Fn(Vec<FloatTensor<B>>, Vec<IntTensor<B>>) -> Vec<FloatTensor<B>> + Send + Sync>;

struct KernelOp<B: FusionBackend> {
    desc: CustomOpIr,
    /// The first `floats` inputs are float tensors, the rest int tensors.
    floats: usize,
    call: Call<B>,
    _b: PhantomData<B>,
}

impl<B: FusionBackend> core::fmt::Debug for KernelOp<B> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "KernelOp({})", self.desc.id)
    }
}

impl<B: FusionBackend> Operation<B::FusionRuntime> for KernelOp<B> {
    fn execute(
        &self,
        handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
    ) {
        let (floats, ints) = self.desc.inputs.split_at(self.floats);
        let floats = floats
            .iter()
            .map(|ir| handles.get_float_tensor::<B>(ir))
            .collect();
        let ints = ints
            .iter()
            .map(|ir| handles.get_int_tensor::<B>(ir))
            .collect();
        let outputs = (self.call)(floats, ints);
        assert_eq!(
            outputs.len(),
            self.desc.outputs.len(),
            "{} returned the wrong number of outputs",
            self.desc.id
        );
        for (ir, out) in self.desc.outputs.iter().zip(outputs) {
            handles.register_float_tensor::<B>(&ir.id, out);
        }
    }
}

/// Records `call` as a custom op with these float inputs and outputs (shape
/// and dtype each) and returns the output tensors.
fn record<B: FusionBackend>(
    name: &'static str,
    inputs: Vec<FloatTensor<Fusion<B>>>,
    outputs: Vec<(Shape, DType)>,
    call: impl Fn(Vec<FloatTensor<B>>) -> Vec<FloatTensor<B>> + Send + Sync + 'static,
) -> Vec<FloatTensor<Fusion<B>>> {
    record_with_ints::<B>(name, inputs, vec![], outputs, move |f, _| call(f))
}

/// [`record`] with int inputs after the float ones.
fn record_with_ints<B: FusionBackend>(
    name: &'static str,
    floats: Vec<FloatTensor<Fusion<B>>>,
    ints: Vec<IntTensor<Fusion<B>>>,
    outputs: Vec<(Shape, DType)>,
    call: impl Fn(Vec<FloatTensor<B>>, Vec<IntTensor<B>>) -> Vec<FloatTensor<B>> + Send + Sync + 'static,
) -> Vec<FloatTensor<Fusion<B>>> {
    let client = floats[0].client.clone();
    let streams = OperationStreams::with_inputs(floats.iter().chain(ints.iter()));
    let outputs: Vec<TensorIr> = outputs
        .into_iter()
        .map(|(shape, dtype)| TensorIr::uninit(client.create_empty_handle(), shape, dtype))
        .collect();
    let n_floats = floats.len();
    let inputs: Vec<TensorIr> = floats
        .into_iter()
        .chain(ints)
        .map(|t| t.into_ir())
        .collect();
    let desc = CustomOpIr::new(name, &inputs, &outputs);
    client.register(
        streams,
        OperationIr::Custom(desc.clone()),
        KernelOp::<B> {
            desc,
            floats: n_floats,
            call: Box::new(call),
            _b: PhantomData,
        },
    )
}

fn with_last(shape: &Shape, last: usize) -> Shape {
    let mut s = shape.clone();
    let d = s.num_dims() - 1;
    s[d] = last;
    s
}

fn glu_parts<T>(g: GluTensors<T>) -> Vec<T> {
    match g {
        GluTensors::Separate { gate, up } => vec![gate, up],
        GluTensors::Packed(both) => vec![both],
    }
}

fn glu_from<T>(packed: bool, mut parts: Vec<T>) -> GluTensors<T> {
    if packed {
        GluTensors::Packed(parts.remove(0))
    } else {
        let up = parts.remove(1);
        GluTensors::Separate {
            gate: parts.remove(0),
            up,
        }
    }
}

impl<B: FusionBackend + KernelBackend> KernelBackend for Fusion<B> {
    fn rms_norm_supported(device: &Device<Self>, hidden: usize, dtype: DType) -> bool {
        B::rms_norm_supported(device, hidden, dtype)
    }

    fn rms_norm_forward_kernel(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        eps: f64,
        cast: RmsNormCast,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let rows = x.shape.num_elements() / x.shape.last().copied().unwrap_or(1).max(1);
        let outputs = vec![(x.shape.clone(), x.dtype), (Shape::new([rows]), DType::F32)];
        let mut out = record::<B>(
            "bastile_rms_norm_forward",
            vec![x, gamma],
            outputs,
            move |mut i| {
                let gamma = i.pop().expect("two inputs");
                let (y, rstd) = B::rms_norm_forward_kernel(i.pop().expect("x"), gamma, eps, cast);
                vec![y, rstd]
            },
        );
        let rstd = out.pop().expect("two outputs");
        (out.pop().expect("two outputs"), rstd)
    }

    fn rms_norm_backward_kernel(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        cast: RmsNormCast,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let outputs = vec![
            (x.shape.clone(), x.dtype),
            (gamma.shape.clone(), gamma.dtype),
        ];
        let mut out = record::<B>(
            "bastile_rms_norm_backward",
            vec![x, gamma, rstd, dy],
            outputs,
            move |i| {
                let [x, gamma, rstd, dy]: [_; 4] =
                    i.try_into().unwrap_or_else(|_| panic!("four inputs"));
                let (dx, dg) = B::rms_norm_backward_kernel(x, gamma, rstd, dy, cast);
                vec![dx, dg]
            },
        );
        let dgamma = out.pop().expect("two outputs");
        (out.pop().expect("two outputs"), dgamma)
    }

    fn elementwise_supported(device: &Device<Self>, dtype: DType) -> bool {
        B::elementwise_supported(device, dtype)
    }

    fn swiglu_forward_kernel(input: GluTensors<FloatTensor<Self>>) -> FloatTensor<Self> {
        let packed = matches!(input, GluTensors::Packed(_));
        let first = input.first();
        let width = *first.shape.last().expect("rank >= 1");
        let inter = if packed { width / 2 } else { width };
        let outputs = vec![(with_last(&first.shape, inter), first.dtype)];
        let mut out = record::<B>(
            "bastile_swiglu_forward",
            glu_parts(input),
            outputs,
            move |i| vec![B::swiglu_forward_kernel(glu_from(packed, i))],
        );
        out.pop().expect("one output")
    }

    fn swiglu_backward_kernel(
        input: GluTensors<FloatTensor<Self>>,
        dout: FloatTensor<Self>,
    ) -> GluTensors<FloatTensor<Self>> {
        let packed = matches!(input, GluTensors::Packed(_));
        let mut inputs = glu_parts(input);
        let outputs = inputs.iter().map(|t| (t.shape.clone(), t.dtype)).collect();
        inputs.push(dout);
        let out = record::<B>("bastile_swiglu_backward", inputs, outputs, move |mut i| {
            let dout = i.pop().expect("dout");
            glu_parts(B::swiglu_backward_kernel(glu_from(packed, i), dout))
        });
        glu_from(packed, out)
    }

    fn geglu_forward_kernel(x: FloatTensor<Self>, alpha: f64, limit: f64) -> FloatTensor<Self> {
        let width = *x.shape.last().expect("rank >= 1");
        let outputs = vec![(with_last(&x.shape, width / 2), x.dtype)];
        let mut out = record::<B>("bastile_geglu_forward", vec![x], outputs, move |mut i| {
            vec![B::geglu_forward_kernel(i.pop().expect("x"), alpha, limit)]
        });
        out.pop().expect("one output")
    }

    fn geglu_backward_kernel(
        x: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        alpha: f64,
        limit: f64,
    ) -> FloatTensor<Self> {
        let outputs = vec![(x.shape.clone(), x.dtype)];
        let mut out = record::<B>(
            "bastile_geglu_backward",
            vec![x, dout],
            outputs,
            move |mut i| {
                let dout = i.pop().expect("dout");
                vec![B::geglu_backward_kernel(
                    i.pop().expect("x"),
                    dout,
                    alpha,
                    limit,
                )]
            },
        );
        out.pop().expect("one output")
    }

    fn rope_kernel(
        q: FloatTensor<Self>,
        k: Option<FloatTensor<Self>>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        options: RopeOptions,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let has_k = k.is_some();
        let mut outputs = vec![(q.shape.clone(), q.dtype)];
        let mut inputs = vec![cos, sin, q];
        if let Some(k) = k {
            outputs.push((k.shape.clone(), k.dtype));
            inputs.push(k);
        }
        let mut out = record::<B>("bastile_rope", inputs, outputs, move |mut i| {
            let k = if has_k { i.pop() } else { None };
            let q = i.pop().expect("q");
            let sin = i.pop().expect("sin");
            let cos = i.pop().expect("cos");
            let (q, k) = B::rope_kernel(q, k, cos, sin, options);
            std::iter::once(q).chain(k).collect()
        });
        let k = if has_k { out.pop() } else { None };
        (out.pop().expect("q output"), k)
    }

    fn matmul_supported(device: &Device<Self>, dtype: DType) -> bool {
        B::matmul_supported(device, dtype)
    }

    fn matmul_kernel(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        // Burn's tensor API validated the shapes before the backend call.
        let shape = burn_std::calculate_matmul_output(&lhs.shape, &rhs.shape)
            .expect("matmul shapes validated by the tensor API");
        let outputs = vec![(shape, lhs.dtype)];
        let has_bias = bias.is_some();
        let inputs = [lhs, rhs].into_iter().chain(bias).collect();
        let mut out = record::<B>("bastile_matmul", inputs, outputs, move |mut i| {
            let bias = has_bias.then(|| i.pop().expect("bias input"));
            let rhs = i.pop().expect("rhs input");
            vec![B::matmul_kernel(i.pop().expect("lhs input"), rhs, bias)]
        });
        out.pop().expect("one output")
    }

    fn cross_entropy_supported(device: &Device<Self>, dtype: DType) -> bool {
        B::cross_entropy_supported(device, dtype)
    }

    fn cross_entropy_kernel(
        logits: FloatTensor<Self>,
        labels: IntTensor<Self>,
        spec: LossSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let n = Shape::new([logits.shape[0]]);
        let outputs = vec![(n.clone(), DType::F32), (n, DType::F32)];
        let mut out = record_with_ints::<B>(
            "bastile_cross_entropy",
            vec![logits],
            vec![labels],
            outputs,
            move |mut f, mut i| {
                let (rows, lse) = B::cross_entropy_kernel(
                    f.pop().expect("logits"),
                    i.pop().expect("labels"),
                    spec,
                );
                vec![rows, lse]
            },
        );
        let lse = out.pop().expect("two outputs");
        (out.pop().expect("two outputs"), lse)
    }

    fn cross_entropy_grad_kernel(
        logits: FloatTensor<Self>,
        labels: IntTensor<Self>,
        lse: FloatTensor<Self>,
        dloss: FloatTensor<Self>,
        spec: LossSpec,
    ) -> FloatTensor<Self> {
        let outputs = vec![(logits.shape.clone(), logits.dtype)];
        let mut out = record_with_ints::<B>(
            "bastile_cross_entropy_grad",
            vec![logits, lse, dloss],
            vec![labels],
            outputs,
            move |f, mut i| {
                let [logits, lse, dloss]: [_; 3] = f
                    .try_into()
                    .unwrap_or_else(|_| panic!("three float inputs"));
                vec![B::cross_entropy_grad_kernel(
                    logits,
                    i.pop().expect("labels"),
                    lse,
                    dloss,
                    spec,
                )]
            },
        );
        out.pop().expect("one output")
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
        let n = Shape::new([hidden.shape[0]]);
        let mut outputs = vec![(n.clone(), DType::F32), (n, DType::F32)];
        if grads {
            outputs.extend(grad_outputs(&hidden, &weight, bias.as_ref()));
        }
        let has_bias = bias.is_some();
        let floats = [Some(hidden), Some(weight), bias]
            .into_iter()
            .flatten()
            .collect();
        let mut out = record_with_ints::<B>(
            "bastile_linear_cross_entropy",
            floats,
            vec![labels],
            outputs,
            move |f, mut i| {
                let (hidden, weight, bias) = linear_inputs::<B>(f, has_bias);
                let (rows, lse, g) = B::linear_cross_entropy_kernel(
                    hidden,
                    weight,
                    bias,
                    i.pop().expect("labels"),
                    spec,
                    grads,
                );
                let mut out = vec![rows, lse];
                out.extend(g.map(LinearGrads::into_vec).unwrap_or_default());
                out
            },
        );
        let grads = grads.then(|| LinearGrads::from_vec(out.split_off(2), has_bias));
        let lse = out.pop().expect("lse");
        (out.pop().expect("losses"), lse, grads)
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
        let outputs = grad_outputs(&hidden, &weight, bias.as_ref());
        let has_bias = bias.is_some();
        let floats = [Some(lse), Some(dloss), Some(hidden), Some(weight), bias]
            .into_iter()
            .flatten()
            .collect();
        let out = record_with_ints::<B>(
            "bastile_linear_cross_entropy_backward",
            floats,
            vec![labels],
            outputs,
            move |mut f, mut i| {
                let rest = f.split_off(2);
                let dloss = f.pop().expect("dloss");
                let lse = f.pop().expect("lse");
                let (hidden, weight, bias) = linear_inputs::<B>(rest, has_bias);
                LinearGrads::into_vec(B::linear_cross_entropy_backward_kernel(
                    hidden,
                    weight,
                    bias,
                    i.pop().expect("labels"),
                    lse,
                    dloss,
                    spec,
                ))
            },
        );
        LinearGrads::from_vec(out, has_bias)
    }

    fn attention_always_fused(device: &Device<Self>, dtype: DType) -> bool {
        B::attention_always_fused(device, dtype)
    }

    fn attention_supported(
        device: &Device<Self>,
        dims: &[Shape; 2],
        dtype: DType,
        spec: &AttentionSpec,
    ) -> bool {
        B::attention_supported(device, dims, dtype, spec)
    }

    fn attention_forward_kernel(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        sinks: Option<FloatTensor<Self>>,
        key_lengths: Option<IntTensor<Self>>,
        spec: AttentionSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let has_sinks = sinks.is_some();
        let rows = Shape::new([q.shape[0], q.shape[1], q.shape[2]]);
        let outputs = vec![(q.shape.clone(), q.dtype), (rows, DType::F32)];
        let floats = [q, k, v].into_iter().chain(sinks).collect();
        let ints = key_lengths.into_iter().collect();
        let mut out = record_with_ints::<B>(
            "bastile_attention_forward",
            floats,
            ints,
            outputs,
            move |mut f, mut i| {
                let sinks = if has_sinks { f.pop() } else { None };
                let [q, k, v]: [_; 3] = f.try_into().unwrap_or_else(|_| panic!("q, k, v"));
                let (out, lse) = B::attention_forward_kernel(q, k, v, sinks, i.pop(), spec);
                vec![out, lse]
            },
        );
        let lse = out.pop().expect("two outputs");
        (out.pop().expect("two outputs"), lse)
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
        let has_sinks = sinks.is_some();
        let mut outputs = vec![
            (q.shape.clone(), q.dtype),
            (k.shape.clone(), k.dtype),
            (v.shape.clone(), v.dtype),
        ];
        if has_sinks {
            let rows = Shape::new([q.shape[0], q.shape[1], q.shape[2]]);
            outputs.push((rows, DType::F32));
        }
        let floats = [q, k, v, out, lse, dout].into_iter().chain(sinks).collect();
        let ints = key_lengths.into_iter().collect();
        let mut g = record_with_ints::<B>(
            "bastile_attention_backward",
            floats,
            ints,
            outputs,
            move |mut f, mut i| {
                let sinks = if has_sinks { f.pop() } else { None };
                let [q, k, v, out, lse, dout]: [_; 6] = f
                    .try_into()
                    .unwrap_or_else(|_| panic!("q, k, v, out, lse, dout"));
                let g = B::attention_backward_kernel(q, k, v, out, lse, dout, sinks, i.pop(), spec);
                [Some(g.q), Some(g.k), Some(g.v), g.sinks]
                    .into_iter()
                    .flatten()
                    .collect()
            },
        );
        let sinks = if has_sinks { g.pop() } else { None };
        let v = g.pop().expect("dv");
        let k = g.pop().expect("dk");
        AttentionGrads {
            q: g.pop().expect("dq"),
            k,
            v,
            sinks,
        }
    }

    fn adamw_clip_kernel(
        grads: Vec<FloatTensor<Self>>,
        max_norm: Option<f64>,
    ) -> FloatTensor<Self> {
        let outputs = vec![(Shape::new([2]), DType::F32)];
        let mut out = record::<B>("bastile_adamw_clip", grads, outputs, move |g| {
            vec![B::adamw_clip_kernel(g, max_norm)]
        });
        out.pop().expect("one output")
    }

    fn adamw_update_kernel(
        params: Vec<AdamWTensors<FloatTensor<Self>>>,
        grads: Vec<FloatTensor<Self>>,
        clip: Option<FloatTensor<Self>>,
        hyper: AdamWStep,
    ) -> Vec<AdamWTensors<FloatTensor<Self>>> {
        // Inputs: every state (3 or 4 tensors each), every gradient, the
        // clip factor; outputs: every state.
        let sizes: Vec<usize> = params.iter().map(AdamWTensors::tensor_count).collect();
        let mut inputs: Vec<_> = params
            .into_iter()
            .flat_map(AdamWTensors::into_vec)
            .collect();
        let outputs = inputs.iter().map(|t| (t.shape.clone(), t.dtype)).collect();
        let states_len = inputs.len();
        let clipped = clip.is_some();
        inputs.extend(grads);
        inputs.extend(clip);
        let sizes_inside = sizes.clone();
        let out = record::<B>("bastile_adamw_update", inputs, outputs, move |mut i| {
            let clip = clipped.then(|| i.pop().expect("the clip factor"));
            let grads = i.split_off(states_len);
            let states = AdamWTensors::split(i, &sizes_inside);
            B::adamw_update_kernel(states, grads, clip, hyper)
                .into_iter()
                .flat_map(AdamWTensors::into_vec)
                .collect()
        });
        AdamWTensors::split(out, &sizes)
    }
}

/// The shapes and dtypes of a linear layer's gradients.
fn grad_outputs<T: burn::tensor::TensorMetadata>(
    hidden: &T,
    weight: &T,
    bias: Option<&T>,
) -> Vec<(Shape, DType)> {
    [Some(hidden), Some(weight), bias]
        .into_iter()
        .flatten()
        .map(|t| (t.shape(), t.dtype()))
        .collect()
}

/// `(hidden, weight, bias)` from the float inputs of a recorded op.
fn linear_inputs<B: KernelBackend>(
    mut f: Vec<FloatTensor<B>>,
    has_bias: bool,
) -> (FloatTensor<B>, FloatTensor<B>, Option<FloatTensor<B>>) {
    let bias = if has_bias { f.pop() } else { None };
    let weight = f.pop().expect("weight");
    (f.pop().expect("hidden"), weight, bias)
}
