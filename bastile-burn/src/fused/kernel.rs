//! How kernels reach a backend: [`KernelBackend`] answers questions about a
//! device and launches [`Kernel`]s, on `CubeBackend` directly and on
//! `Fusion<B>` as a custom op of its stream (`fusion.rs`). Backends without
//! CubeCL (NdArray) have no kernels, so every op takes its composite path.

use burn::backend::NdArray;
use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Device, Shape, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

/// The shape and dtype of a kernel's output, known before it runs (a
/// fusion stream allocates its outputs when it records the op).
#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    pub shape: Shape,
    pub dtype: DType,
}

impl TensorSpec {
    pub fn new(shape: Shape, dtype: DType) -> Self {
        Self { shape, dtype }
    }

    /// A tensor's own shape and dtype.
    pub fn of<T: TensorMetadata>(t: &T) -> Self {
        Self::new(t.shape(), t.dtype())
    }
}

/// One launch of Bastile's kernels on flat lists of tensors. The op that
/// builds it orders the inputs and reads the outputs back; the value holds
/// everything else the launch needs.
pub trait Kernel: Clone + Send + Sync + 'static {
    /// The name of the custom op a fusion stream records.
    const NAME: &'static str;

    /// Whether a launch is handed to the device at once. CubeCL's device
    /// threads and Burn's fusion stream take tasks in batches and start
    /// a batch once it fills or someone waits; a kernel long enough that
    /// the GPU should start on it while the host carries on (attention)
    /// would otherwise sit queued, and a call followed by a wait (a
    /// step's loss read, a benchmark's sample) would leave the GPU idle
    /// until the wait.
    const DISPATCH_AT_ONCE: bool = false;

    /// Launches on `CubeBackend<R, F, I, BT>` (the element types matter to
    /// kernels that fall back to the backend's own ops). Returns the
    /// outputs in the order the op declared them.
    fn launch<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
        &self,
        floats: Vec<CubeTensor<R>>,
        ints: Vec<CubeTensor<R>>,
    ) -> Vec<CubeTensor<R>>;
}

/// A question about what the kernels can do on one device (a dtype, a
/// shared-memory budget, tensor cores, a vendor BLAS).
pub trait DeviceQuery {
    type Answer;

    fn ask<R: CubeRuntime>(&self, device: &R::Device) -> Self::Answer;
}

/// Whether the element-wise kernels (SwiGLU, GEGLU, RoPE, AdamW) take
/// `dtype`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DTypeQuery {
    pub dtype: DType,
}

impl DeviceQuery for DTypeQuery {
    type Answer = bool;

    fn ask<R: CubeRuntime>(&self, device: &R::Device) -> bool {
        super::kernel_dtype(self.dtype)
            .is_some_and(|d| R::client(device).properties().supports_type(d.storage()))
    }
}

/// `Some(())` when `K`'s kernels answer yes to `query` on `device`: the
/// plan of ops whose kernels have no choice to make.
pub fn supported<K: KernelBackend, Q: DeviceQuery<Answer = bool>>(
    device: &Device<K>,
    query: &Q,
) -> Option<()> {
    K::ask(device, query).unwrap_or(false).then_some(())
}

/// A backend that can run Bastile's kernels.
pub trait KernelBackend: Backend {
    /// The device's answer to `query`, or `None` on a backend without
    /// kernels.
    fn ask<Q: DeviceQuery>(_device: &Device<Self>, _query: &Q) -> Option<Q::Answer> {
        None
    }

    /// Launches `kernel`; `outputs` are the float shapes and dtypes it
    /// returns. Only called after [`KernelBackend::ask`] answered for the
    /// problem.
    fn launch<K: Kernel>(
        kernel: &K,
        floats: Vec<FloatTensor<Self>>,
        ints: Vec<IntTensor<Self>>,
        outputs: Vec<TensorSpec>,
    ) -> Vec<FloatTensor<Self>> {
        Self::launch_split(kernel, floats, ints, outputs, Vec::new()).0
    }

    /// Launches `kernel` on int tensors only, for the int tensors it
    /// returns (an int reduction).
    fn launch_ints<K: Kernel>(
        kernel: &K,
        ints: Vec<IntTensor<Self>>,
        outputs: Vec<TensorSpec>,
    ) -> Vec<IntTensor<Self>> {
        Self::launch_split(kernel, Vec::new(), ints, Vec::new(), outputs).1
    }

    /// Launches `kernel` for float tensors followed by int tensors (a
    /// choice and its indices): `float_outputs` and `int_outputs` are what
    /// it returns, in that order. The general form of the two above, and
    /// the one launch a backend with kernels implements.
    fn launch_split<K: Kernel>(
        _kernel: &K,
        _floats: Vec<FloatTensor<Self>>,
        _ints: Vec<IntTensor<Self>>,
        _float_outputs: Vec<TensorSpec>,
        _int_outputs: Vec<TensorSpec>,
    ) -> (Vec<FloatTensor<Self>>, Vec<IntTensor<Self>>) {
        unreachable!("{} launched on a backend without kernels", K::NAME)
    }

    /// [`KernelBackend::ask`], on a backend that hands every op to CubeCL
    /// when it is called; `None` where ops wait in a stream of their own
    /// (Burn's fusion) or there are no kernels. Recording a step's GPU
    /// work ([`crate::graph`]) needs the ops issued in order.
    fn ask_in_order<Q: DeviceQuery>(_device: &Device<Self>, _query: &Q) -> Option<Q::Answer> {
        None
    }

    /// Runs `kernel` for what it does to `floats` and `ints` (it returns
    /// nothing), on a backend that hands every op to CubeCL when it is
    /// called; `None` elsewhere, as [`KernelBackend::ask_in_order`].
    fn run_in_order<K: Kernel>(
        _kernel: &K,
        _floats: Vec<FloatTensor<Self>>,
        _ints: Vec<IntTensor<Self>>,
    ) -> Option<()> {
        None
    }
}

impl KernelBackend for NdArray {}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> KernelBackend
    for CubeBackend<R, F, I, BT>
{
    fn ask<Q: DeviceQuery>(device: &Device<Self>, query: &Q) -> Option<Q::Answer> {
        Some(query.ask::<R>(device))
    }

    fn ask_in_order<Q: DeviceQuery>(device: &Device<Self>, query: &Q) -> Option<Q::Answer> {
        Some(query.ask::<R>(device))
    }

    fn run_in_order<K: Kernel>(
        kernel: &K,
        floats: Vec<FloatTensor<Self>>,
        ints: Vec<IntTensor<Self>>,
    ) -> Option<()> {
        let returned = kernel.launch::<R, F, I, BT>(floats, ints);
        debug_assert!(returned.is_empty(), "{} returns nothing", K::NAME);
        Some(())
    }

    fn launch_split<K: Kernel>(
        kernel: &K,
        floats: Vec<FloatTensor<Self>>,
        ints: Vec<IntTensor<Self>>,
        float_outputs: Vec<TensorSpec>,
        int_outputs: Vec<TensorSpec>,
    ) -> (Vec<FloatTensor<Self>>, Vec<IntTensor<Self>>) {
        let dispatch = K::DISPATCH_AT_ONCE
            .then(|| floats.iter().chain(&ints).next().map(|t| t.device.clone()))
            .flatten();
        let outputs = split_outputs(float_outputs, int_outputs, |declared| {
            checked_outputs::<R, K>(kernel.launch::<R, F, I, BT>(floats, ints), declared)
        });
        if let Some(device) = dispatch {
            dispatch_queued::<R>(&device);
        }
        outputs
    }
}

/// Starts the tasks queued for `device`'s CubeCL thread (the launches just
/// made among them) without waiting for them.
fn dispatch_queued<R: CubeRuntime>(device: &R::Device) {
    use cubecl::device::Device as _;
    cubecl::device_handle::DeviceHandle::<<R as cubecl::Runtime>::Server>::new(device.to_id())
        .flush_queue();
}

/// Runs `launch` on the float outputs' specs followed by the int outputs'
/// (one list, as kernels return them) and splits what it returns the same
/// way.
pub(super) fn split_outputs<T>(
    float_outputs: Vec<TensorSpec>,
    int_outputs: Vec<TensorSpec>,
    launch: impl FnOnce(Vec<TensorSpec>) -> Vec<T>,
) -> (Vec<T>, Vec<T>) {
    let split = float_outputs.len();
    let mut floats = launch(float_outputs.into_iter().chain(int_outputs).collect());
    let ints = floats.split_off(split);
    (floats, ints)
}

/// A kernel's outputs, checked (in debug builds) against the shapes and
/// dtypes it declared: those are what a fusion stream allocates, and a
/// mismatch would hand later ops a wrong tensor.
fn checked_outputs<R: CubeRuntime, K: Kernel>(
    out: Vec<CubeTensor<R>>,
    declared: Vec<TensorSpec>,
) -> Vec<CubeTensor<R>> {
    debug_assert_eq!(
        out.iter().map(TensorSpec::of).collect::<Vec<_>>(),
        declared,
        "{} returned other outputs than it declared",
        K::NAME
    );
    out
}
