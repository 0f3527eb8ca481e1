//! Moves the few op results that are structs generic over the backend from
//! `B`'s type to `Bastile<B>`'s. The fields are the same primitives: these
//! are moves, not copies.

use crate::fused::KernelBackend;
use burn::tensor::TensorPrimitive;
use burn::tensor::ops::{
    DeformConv2dBackward, MaxPool1dBackward, MaxPool1dWithIndices, MaxPool2dBackward,
    MaxPool2dWithIndices,
};

use super::Bastile;

pub(super) fn prim_out<B: KernelBackend>(p: TensorPrimitive<B>) -> TensorPrimitive<Bastile<B>> {
    match p {
        TensorPrimitive::Float(t) => TensorPrimitive::Float(t),
        TensorPrimitive::QFloat(t) => TensorPrimitive::QFloat(t),
    }
}

pub(super) fn prim_in<B: KernelBackend>(p: TensorPrimitive<Bastile<B>>) -> TensorPrimitive<B> {
    match p {
        TensorPrimitive::Float(t) => TensorPrimitive::Float(t),
        TensorPrimitive::QFloat(t) => TensorPrimitive::QFloat(t),
    }
}

pub(super) fn pool1d_indices_out<B: KernelBackend>(
    p: MaxPool1dWithIndices<B>,
) -> MaxPool1dWithIndices<Bastile<B>> {
    MaxPool1dWithIndices::new(p.output, p.indices)
}

pub(super) fn pool2d_indices_out<B: KernelBackend>(
    p: MaxPool2dWithIndices<B>,
) -> MaxPool2dWithIndices<Bastile<B>> {
    MaxPool2dWithIndices::new(p.output, p.indices)
}

pub(super) fn pool1d_backward_out<B: KernelBackend>(
    p: MaxPool1dBackward<B>,
) -> MaxPool1dBackward<Bastile<B>> {
    MaxPool1dBackward::new(p.x_grad)
}

pub(super) fn pool2d_backward_out<B: KernelBackend>(
    p: MaxPool2dBackward<B>,
) -> MaxPool2dBackward<Bastile<B>> {
    MaxPool2dBackward::new(p.x_grad)
}

pub(super) fn deform_conv2d_backward_out<B: KernelBackend>(
    p: DeformConv2dBackward<B>,
) -> DeformConv2dBackward<Bastile<B>> {
    DeformConv2dBackward::new(
        p.x_grad,
        p.offset_grad,
        p.weight_grad,
        p.mask_grad,
        p.bias_grad,
    )
}
