//! The fused ops, one folder each: the checked entry point, the composite
//! reference and the [`crate::fused::FusedOp`] declarations in `mod.rs`,
//! the autodiff node next to them, the kernel launches in `kernel.rs`.

pub mod adamw;
pub mod attention;
pub mod combine_rows;
pub mod cross_entropy;
pub mod embedding;
pub mod expert_groups;
pub mod gather_rows;
pub mod geglu;
pub mod linear;
pub mod linear_cross_entropy;
pub mod lora;
pub mod reduce;
pub mod rms_norm;
pub mod rope;
pub mod router;
pub mod swiglu;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor, TensorMetadata, TensorPrimitive};

use crate::BastileError;
use cross_entropy::LossSpec;

pub use crate::fused::{BastileBackend, KernelBackend};

/// Per-token losses reduced as `spec` says (`Mean` / `Sum`: scaled sum),
/// in the kernel paths of the losses: on `Bastile<K>`, whose sum has a
/// fixed strategy (`K`'s own would tune it).
pub(crate) fn reduce_rows<K: KernelBackend>(
    rows: FloatTensor<K>,
    spec: &LossSpec,
) -> FloatTensor<K> {
    cross_entropy::reduce(float::<crate::Bastile<K>, 1>(rows), spec)
        .into_primitive()
        .tensor()
}

/// The tensor as f32 (upstream gradients may come in any float dtype).
pub(crate) fn f32_of<B: Backend>(t: FloatTensor<B>) -> FloatTensor<B> {
    cast_to::<B>(t, DType::F32)
}

/// The tensor in `dtype` (no op when it already is).
pub(crate) fn cast_to<B: Backend>(t: FloatTensor<B>, dtype: DType) -> FloatTensor<B> {
    if t.dtype() == dtype {
        t
    } else {
        B::float_cast(t, dtype.into())
    }
}

/// A primitive as a tensor of rank `D`.
pub(crate) fn float<B: Backend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// Errors unless `dtype` is a floating-point dtype.
pub(crate) fn check_float(what: &str, dtype: DType) -> Result<(), BastileError> {
    if matches!(dtype, DType::F32 | DType::F16 | DType::BF16 | DType::F64) {
        Ok(())
    } else {
        Err(BastileError::DType(format!(
            "{what} must be floating point, got {dtype:?}"
        )))
    }
}

/// Errors unless a layer's tensor `what` (a weight, a bias) has the dtype
/// and device of its input `x`, named `input`.
pub(crate) fn check_like_input<B: Backend, const D: usize>(
    input: &str,
    x: &Tensor<B, D>,
    what: &str,
    dtype: DType,
    device: &B::Device,
) -> Result<(), BastileError> {
    check_same_device(input, &x.device(), what, device)?;
    if dtype != x.dtype() {
        return Err(BastileError::DType(format!(
            "{what} must have the dtype of {input}, {:?}, got {dtype:?}",
            x.dtype()
        )));
    }
    Ok(())
}

/// Errors unless both devices are the same.
pub(crate) fn check_same_device<D: PartialEq + core::fmt::Debug>(
    a_what: &str,
    a: &D,
    b_what: &str,
    b: &D,
) -> Result<(), BastileError> {
    if a == b {
        Ok(())
    } else {
        Err(BastileError::Device(format!(
            "{a_what} is on {a:?} but {b_what} is on {b:?}"
        )))
    }
}
