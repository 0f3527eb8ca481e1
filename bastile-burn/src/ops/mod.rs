//! The fused ops: [`BastileBackend`] and its implementations.
//!
//! * Every method has a composite default written with plain Burn ops: the
//!   reference semantics, and what every backend gets for free.
//! * `Bastile<B>` overrides the `*_fused` predicates and the forward /
//!   backward methods with kernels, through [`KernelBackend`].
//! * `Autodiff<B>` builds one autodiff node per fused op whose backward is
//!   `B`'s backward method (see each op's file), and takes the composite
//!   path when `B` has no fused kernel for the input.

pub mod rms_norm;

use burn::backend::NdArray;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Device};
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use crate::{Bastile, RmsNormCast, patches};

pub use crate::kernels::KernelBackend;

/// The fused ops of Bastile, on primitives. The public, checked entry points
/// are the functions of each op module (e.g. [`rms_norm::rms_norm`]) and the
/// [`crate::nn`] modules; these methods assume validated inputs.
pub trait BastileBackend: Backend {
    /// Whether [`BastileBackend::rms_norm_forward`] runs a fused kernel for
    /// this input (as opposed to the composite reference).
    fn rms_norm_fused(_device: &Device<Self>, _hidden: usize, _dtype: DType) -> bool {
        false
    }

    /// RMSNorm over the last dimension of `x`, scaled by `gamma`.
    fn rms_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        eps: f64,
        cast: RmsNormCast,
    ) -> FloatTensor<Self> {
        Self::rms_norm_forward(x, gamma, eps, cast).0
    }

    /// RMSNorm forward that also returns the per-row `rstd` (f32, one value
    /// per row) that [`BastileBackend::rms_norm_backward`] takes.
    fn rms_norm_forward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        eps: f64,
        cast: RmsNormCast,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        rms_norm::composite_forward::<Self>(x, gamma, eps, cast)
    }

    /// RMSNorm backward: `(dx, dgamma)` from the forward's inputs, its saved
    /// `rstd` and the output gradient `dy`.
    fn rms_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        cast: RmsNormCast,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        rms_norm::composite_backward::<Self>(x, gamma, rstd, dy, cast)
    }
}

// The plain backends Bastile is compared against: composite everywhere.
impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> BastileBackend
    for CubeBackend<R, F, I, BT>
{
}
impl<B: burn_fusion::FusionBackend> BastileBackend for burn_fusion::Fusion<B> {}
impl BastileBackend for NdArray {}

impl<B: KernelBackend> BastileBackend for Bastile<B> {
    fn rms_norm_fused(device: &Device<Self>, hidden: usize, dtype: DType) -> bool {
        patches::is_enabled(patches::Op::RmsNorm) && B::rms_norm_supported(device, hidden, dtype)
    }

    fn rms_norm_forward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        eps: f64,
        cast: RmsNormCast,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let device = B::float_device(&x);
        let hidden = rms_norm::hidden_of::<B>(&x);
        if Self::rms_norm_fused(&device, hidden, burn::tensor::TensorMetadata::dtype(&x)) {
            B::rms_norm_forward_kernel(x, gamma, eps, cast)
        } else {
            rms_norm::composite_forward::<B>(x, gamma, eps, cast)
        }
    }

    fn rms_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        cast: RmsNormCast,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let device = B::float_device(&x);
        let hidden = rms_norm::hidden_of::<B>(&x);
        if Self::rms_norm_fused(&device, hidden, burn::tensor::TensorMetadata::dtype(&x)) {
            B::rms_norm_backward_kernel(x, gamma, rstd, dy, cast)
        } else {
            rms_norm::composite_backward::<B>(x, gamma, rstd, dy, cast)
        }
    }
}

impl<B: BastileBackend, C: CheckpointStrategy> BastileBackend for Autodiff<B, C> {
    fn rms_norm_fused(device: &Device<Self>, hidden: usize, dtype: DType) -> bool {
        B::rms_norm_fused(device, hidden, dtype)
    }

    fn rms_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        eps: f64,
        cast: RmsNormCast,
    ) -> FloatTensor<Self> {
        rms_norm::autodiff::<B, C>(x, gamma, eps, cast)
    }
}
