//! SwiGLU: the checked public entry points, the composite reference and
//! the fused op's declaration; its autodiff nodes in `autodiff.rs`, its
//! kernel launches in `kernel.rs`.
//!
//! Semantics (HF transformers, eager): `out = cast(silu(g)) · up`, silu
//! computed in f32 and stored in the input dtype, as `act_fn(gate) * up`
//! does. Backward recomputes the sigmoid from `gate`.

mod autodiff;
mod kernel;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Device, Distribution, Tensor, TensorMetadata};

use crate::fused::{DTypeQuery, In, KernelBackend, Out, TensorSpec, fused_op, unpack};
use crate::ops::{check_float, check_same_device, float};
use crate::patches::Op;
use crate::{BastileBackend, BastileError};

/// Gate and up activations (or their gradients): two tensors of the same
/// shape, or one tensor whose last dimension holds the gate half then the
/// up half (the output of one fused gate+up projection).
#[derive(Clone, Debug)]
pub enum GluTensors<T> {
    Separate { gate: T, up: T },
    Packed(T),
}

impl<T> GluTensors<T> {
    /// Applies `f` to every tensor.
    pub fn map<U>(self, mut f: impl FnMut(T) -> U) -> GluTensors<U> {
        match self {
            GluTensors::Separate { gate, up } => GluTensors::Separate {
                gate: f(gate),
                up: f(up),
            },
            GluTensors::Packed(both) => GluTensors::Packed(f(both)),
        }
    }

    /// The first tensor (the gate, or the packed tensor).
    pub fn first(&self) -> &T {
        match self {
            GluTensors::Separate { gate, .. } => gate,
            GluTensors::Packed(both) => both,
        }
    }

    /// Whether this is the packed form.
    pub fn is_packed(&self) -> bool {
        matches!(self, GluTensors::Packed(_))
    }

    /// The tensors as a list: `[gate, up]` or `[both]`.
    pub fn into_vec(self) -> Vec<T> {
        match self {
            GluTensors::Separate { gate, up } => vec![gate, up],
            GluTensors::Packed(both) => vec![both],
        }
    }

    /// The inverse of [`GluTensors::into_vec`], for the given form: takes
    /// its tensors from the front of `list`.
    pub(crate) fn take_from(packed: bool, list: &mut Vec<T>) -> Self {
        if packed {
            GluTensors::Packed(list.remove(0))
        } else {
            let gate = list.remove(0);
            GluTensors::Separate {
                gate,
                up: list.remove(0),
            }
        }
    }
}

/// `silu(gate) · up` for two tensors of the same shape.
///
/// Errors when the shapes, dtypes or devices differ or the dtype is not
/// floating point.
///
/// # Shapes
///
/// - `gate`, `up`: `[..., d]`
/// - output: `[..., d]`
pub fn swiglu<B: BastileBackend, const D: usize>(
    gate: Tensor<B, D>,
    up: Tensor<B, D>,
) -> Result<Tensor<B, D>, BastileError> {
    check_float("SwiGLU gate", gate.dtype())?;
    if gate.dims() != up.dims() {
        return Err(BastileError::Shape(format!(
            "SwiGLU gate has shape {:?} but up has shape {:?}",
            gate.dims(),
            up.dims()
        )));
    }
    if gate.dtype() != up.dtype() {
        return Err(BastileError::DType(format!(
            "SwiGLU gate is {:?} but up is {:?}",
            gate.dtype(),
            up.dtype()
        )));
    }
    check_same_device("SwiGLU gate", &gate.device(), "up", &up.device())?;
    let out = B::run(
        &SwiGlu,
        GluTensors::Separate {
            gate: gate.into_primitive().tensor(),
            up: up.into_primitive().tensor(),
        },
    );
    Ok(float(out))
}

/// `silu(gate) · up` where the last dimension of `gate_up` holds the gate
/// half then the up half; the output's last dimension is half as wide.
///
/// Errors when the last dimension is odd or the dtype is not floating point.
///
/// # Shapes
///
/// - `gate_up`: `[..., 2·d]`, the gate half first
/// - output: `[..., d]`
pub fn swiglu_packed<B: BastileBackend, const D: usize>(
    gate_up: Tensor<B, D>,
) -> Result<Tensor<B, D>, BastileError> {
    check_float("SwiGLU gate_up", gate_up.dtype())?;
    let dims = gate_up.dims();
    if D == 0 || !dims[D - 1].is_multiple_of(2) {
        return Err(BastileError::Shape(format!(
            "packed SwiGLU needs an even last dimension (gate then up), got shape {dims:?}"
        )));
    }
    let out = B::run(
        &SwiGlu,
        GluTensors::Packed(gate_up.into_primitive().tensor()),
    );
    Ok(float(out))
}

/// Splits a packed tensor into its gate and up halves (views).
fn split<B: Backend>(both: FloatTensor<B>) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let shape = both.shape();
    let width = *shape.last().expect("rank >= 1");
    let rows = shape.num_elements() / width.max(1);
    let inter = width / 2;
    let t = float::<B, 2>(B::float_reshape(both, [rows, width].into()));
    (
        t.clone().slice([0..rows, 0..inter]),
        t.slice([0..rows, inter..width]),
    )
}

/// `(gate, up)` as 2-D `[rows, inter]` tensors, and the output shape.
fn operands<B: Backend>(
    input: GluTensors<FloatTensor<B>>,
) -> (Tensor<B, 2>, Tensor<B, 2>, burn::tensor::Shape) {
    match input {
        GluTensors::Separate { gate, up } => {
            let shape = gate.shape();
            let inter = *shape.last().expect("rank >= 1");
            let rows = shape.num_elements() / inter.max(1);
            (
                float::<B, 2>(gate).reshape([rows, inter]),
                float::<B, 2>(up).reshape([rows, inter]),
                shape,
            )
        }
        GluTensors::Packed(both) => {
            let mut shape = both.shape();
            let (g, u) = split::<B>(both);
            let last = shape.num_dims() - 1;
            shape[last] /= 2;
            (g, u, shape)
        }
    }
}

/// Reference forward with plain Burn ops.
pub fn composite_forward<B: Backend>(input: GluTensors<FloatTensor<B>>) -> FloatTensor<B> {
    let (gate, up, shape) = operands::<B>(input);
    let dtype = gate.dtype();
    let g = gate.cast(DType::F32);
    let a = (g.clone() * burn::tensor::activation::sigmoid(g)).cast(dtype);
    B::float_reshape((a * up).into_primitive().tensor(), shape)
}

/// Reference backward with plain Burn ops: the gradients in the input's form.
pub fn composite_backward<B: Backend>(
    input: GluTensors<FloatTensor<B>>,
    dout: FloatTensor<B>,
) -> GluTensors<FloatTensor<B>> {
    let packed = matches!(input, GluTensors::Packed(_));
    let in_shape = input.first().shape();
    let (gate, up, _) = operands::<B>(input);
    let dtype = gate.dtype();
    let d = float::<B, 2>(dout).reshape(gate.dims());
    let g = gate.cast(DType::F32);
    let s = burn::tensor::activation::sigmoid(g.clone());
    let a = (g.clone() * s.clone()).cast(dtype);
    let da = (d.clone() * up).cast(DType::F32);
    let dg = (da * s.clone() * ((s.neg() + 1.0) * g + 1.0)).cast(dtype);
    let du = d * a;
    if packed {
        let both = Tensor::cat(vec![dg, du], 1);
        GluTensors::Packed(B::float_reshape(both.into_primitive().tensor(), in_shape))
    } else {
        GluTensors::Separate {
            gate: B::float_reshape(dg.into_primitive().tensor(), in_shape.clone()),
            up: B::float_reshape(du.into_primitive().tensor(), in_shape),
        }
    }
}

/// SwiGLU forward: `silu(gate) · up`.
#[derive(Clone, Copy, Debug)]
pub struct SwiGlu;

/// SwiGLU backward: `(input, dout)` to the gradients in the input's form.
#[derive(Clone, Copy, Debug)]
pub struct SwiGluBackward;

/// The device and dtype of a GLU input.
pub(crate) fn glu_problem<B: Backend>(
    input: &GluTensors<FloatTensor<B>>,
) -> (Device<B>, DTypeQuery) {
    let first = input.first();
    (
        B::float_device(first),
        DTypeQuery {
            dtype: first.dtype(),
        },
    )
}

fused_op! {
    SwiGlu: Some(Op::SwiGlu), GluTensors<F> => F, differentiable,
    |_, input| -> DTypeQuery { glu_problem::<B>(input) }

    fn composite<B: Backend>(&self, input: In<Self, B>) -> Out<Self, B> {
        composite_forward::<B>(input)
    }

    fn kernels<K: KernelBackend>(&self, _: (), input: In<Self, K>) -> Out<Self, K> {
        let first = input.first();
        let mut shape = first.shape();
        let last = shape.num_dims() - 1;
        if input.is_packed() {
            shape[last] /= 2;
        }
        let outputs = vec![TensorSpec::new(shape, first.dtype())];
        let [out] = unpack(K::launch(self, input.into_vec(), vec![], outputs));
        out
    }
}

fused_op! {
    SwiGluBackward: Some(Op::SwiGlu), (GluTensors<F>, F) => GluTensors<F>,
    |_, (input, _)| -> DTypeQuery { glu_problem::<B>(input) }

    fn composite<B: Backend>(&self, (input, dout): In<Self, B>) -> Out<Self, B> {
        composite_backward::<B>(input, dout)
    }

    fn kernels<K: KernelBackend>(&self, _: (), (input, dout): In<Self, K>) -> Out<Self, K> {
        let packed = input.is_packed();
        let mut inputs = input.into_vec();
        let outputs = inputs.iter().map(TensorSpec::of).collect();
        inputs.push(dout);
        let mut grads = K::launch(self, inputs, vec![], outputs);
        GluTensors::take_from(packed, &mut grads)
    }
}

/// Compiles (and autotunes) the SwiGLU kernels for a few widths.
pub(crate) fn warmup<B: BastileBackend>(device: &B::Device) {
    for (rows, inter) in [(256, 1024), (256, 3072)] {
        let gate = Tensor::<B, 2>::random([rows, inter], Distribution::Normal(0.0, 1.0), device);
        let up = Tensor::<B, 2>::random([rows, inter], Distribution::Normal(0.0, 1.0), device);
        let input = GluTensors::Separate {
            gate: gate.into_primitive().tensor(),
            up: up.into_primitive().tensor(),
        };
        let out = B::run(&SwiGlu, input.clone());
        let _ = B::run(&SwiGluBackward, (input, out));
    }
    let _ = B::sync(device);
}
