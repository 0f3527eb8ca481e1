//! `Bastile<B>`: a Burn backend that is `B` with Bastile's fused ops on top.
//!
//! Every Burn op is forwarded to `B` with `B`'s own primitive types (see
//! `forward.rs`), so wrapping costs nothing and `Autodiff<Bastile<B>>`,
//! `Fusion`-based backends and plain `CubeBackend`s all keep working. The
//! fused ops themselves are the [`crate::BastileBackend`] trait.

mod attention;
mod convert;
#[cfg(feature = "distributed")]
mod distributed;
mod forward;
pub(crate) mod matmul;

use core::marker::PhantomData;

use burn::tensor::backend::{Backend, BackendTypes, DTypeUsageSet, ExecutionError};
use burn::tensor::{DType, TensorData};

use crate::fused::KernelBackend;

/// The Bastile backend decorator: `B` with fused training kernels.
///
/// ```rust
/// // `burn::backend::Cuda` or `Wgpu` in place of NdArray run the kernels.
/// type B = burn::backend::Autodiff<bastile::Bastile<burn::backend::NdArray>>;
/// let device = Default::default();
/// let x = burn::tensor::Tensor::<B, 1>::ones([3], &device);
/// assert_eq!(x.sum().into_scalar(), 3.0);
/// ```
#[derive(Clone, Copy, Default, Debug)]
pub struct Bastile<B>(PhantomData<B>);

impl<B: Backend> BackendTypes for Bastile<B> {
    type Device = B::Device;
    type FloatTensorPrimitive = B::FloatTensorPrimitive;
    type FloatElem = B::FloatElem;
    type IntTensorPrimitive = B::IntTensorPrimitive;
    type IntElem = B::IntElem;
    type BoolTensorPrimitive = B::BoolTensorPrimitive;
    type BoolElem = B::BoolElem;
    type QuantizedTensorPrimitive = B::QuantizedTensorPrimitive;
}

impl<B: KernelBackend> Backend for Bastile<B> {
    fn ad_enabled(device: &Self::Device) -> bool {
        B::ad_enabled(device)
    }

    fn memory_persistent_allocations<
        Output: Send,
        Input: Send,
        Func: Fn(Input) -> Output + Send,
    >(
        device: &Self::Device,
        input: Input,
        func: Func,
    ) -> Output {
        B::memory_persistent_allocations(device, input, func)
    }

    fn memory_cleanup(device: &Self::Device) {
        B::memory_cleanup(device)
    }

    fn name(device: &Self::Device) -> String {
        format!("bastile<{}>", B::name(device))
    }

    fn seed(device: &Self::Device, seed: u64) {
        B::seed(device, seed)
    }

    fn sync(device: &Self::Device) -> Result<(), ExecutionError> {
        B::sync(device)
    }

    fn staging<'a, Iter>(data: Iter, device: &Self::Device)
    where
        Iter: Iterator<Item = &'a mut TensorData>,
    {
        B::staging(data, device)
    }

    fn supports_dtype(device: &Self::Device, dtype: DType) -> bool {
        B::supports_dtype(device, dtype)
    }

    fn dtype_usage(device: &Self::Device, dtype: DType) -> DTypeUsageSet {
        B::dtype_usage(device, dtype)
    }

    fn device_count(type_id: u16) -> usize {
        B::device_count(type_id)
    }
}
