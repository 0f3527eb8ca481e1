//! What every fused op shares: how it is declared ([`FusedOp`]), how each
//! backend runs it ([`BastileBackend`]) and how its kernels are launched
//! ([`KernelBackend`], [`Kernel`]).
//!
//! A call travels from a model to a kernel like this:
//!
//! 1. The op's checked entry point (e.g. [`crate::rms_norm`]) validates the
//!    tensors and calls `B::run(&op, input)`.
//! 2. On `Autodiff<B>`, `run` asks `B` for a plan; with one, the op's
//!    [`FusedOp::autodiff`] builds a single node whose forward is
//!    `B::run(&op, ..)` and whose backward runs the op's backward
//!    [`FusedOp`] on `B`. Without one, the composite graph is recorded.
//! 3. On `Bastile<B>`, `run` plans the call once ([`FusedOp::plan`]: the
//!    patch switch, then the device's answer to the op's [`DeviceQuery`])
//!    and runs [`FusedOp::kernels`] with that plan, or
//!    [`FusedOp::composite`] without one.
//! 4. `kernels` lays the tensors out as flat lists and calls
//!    [`KernelBackend::launch`]: `Fusion<B>` records one custom op that
//!    launches on `B` when its stream runs; `CubeBackend` runs
//!    [`Kernel::launch`] at once.
//!
//! Every other backend (`NdArray`, plain `CubeBackend`, `Fusion`) takes the
//! composite path: the reference semantics, with plain Burn ops.

mod autodiff;
pub(crate) mod cube;
mod declare;
mod fusion;
mod kernel;

use burn::backend::NdArray;
use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Device};
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use crate::Bastile;
use crate::patches::{self, Op};

pub use crate::backend::matmul::MatmulQuery;
pub(crate) use autodiff::{Recompute, register_grads};
pub(crate) use declare::{fused_op, kernel};
pub use kernel::{DTypeQuery, DeviceQuery, Kernel, KernelBackend, TensorSpec, supported};

/// An op's input on backend `B`.
pub type In<O, B> = <O as FusedOp>::Input<FloatTensor<B>, IntTensor<B>>;
/// An op's output on backend `B`.
pub type Out<O, B> = <O as FusedOp>::Output<FloatTensor<B>, IntTensor<B>>;

/// One fused op: its tensors, its reference semantics, how the kernels
/// take it, and (for ops a model differentiates) its autodiff node.
///
/// The op value itself holds what the call does besides its tensors
/// (epsilon, scale, options); it is small and copied into recorded ops.
pub trait FusedOp: Sized {
    /// The switch that turns its kernels off (see [`crate::apply`]), if it
    /// has one.
    const PATCH: Option<Op>;

    /// Its input tensors, generic over the float and int tensor types so
    /// that one declaration serves every backend.
    type Input<F, I>;

    /// Its output tensors.
    type Output<F, I>;

    /// What the kernels' choice depends on, read from the input's shapes
    /// and dtypes.
    type Problem;

    /// How the kernels run a problem on a device (the kernel family, block
    /// shapes), decided once per call.
    type Plan;

    /// The input's device and problem.
    fn problem<B: Backend>(&self, input: &In<Self, B>) -> (Device<B>, Self::Problem);

    /// How `K`'s kernels run `problem` on `device`, or `None` when they do
    /// not take it. The patch switch is checked by the caller.
    fn plan<K: KernelBackend>(
        &self,
        device: &Device<K>,
        problem: &Self::Problem,
    ) -> Option<Self::Plan>;

    /// The reference semantics, with plain Burn ops.
    fn composite<B: Backend>(&self, input: In<Self, B>) -> Out<Self, B>;

    /// The kernels, as `plan` said.
    fn kernels<K: KernelBackend>(&self, plan: Self::Plan, input: In<Self, K>) -> Out<Self, K>;

    /// `Autodiff<B>`'s op when `B` runs it fused: a node whose backward is
    /// the fused backward. By default the composite graph (ops that are
    /// never differentiated, such as the backward passes themselves).
    fn autodiff<B: BastileBackend, C: CheckpointStrategy>(
        &self,
        input: In<Self, Autodiff<B, C>>,
    ) -> Out<Self, Autodiff<B, C>> {
        self.composite::<Autodiff<B, C>>(input)
    }
}

/// A backend that runs Bastile's fused ops: with kernels on `Bastile<B>`,
/// with one autodiff node each on `Autodiff<B>`, and as their composite
/// reference on every other backend.
pub trait BastileBackend: Backend {
    /// How this backend's kernels run `op` for `problem`, or `None` when it
    /// takes the composite path.
    fn plan<O: FusedOp>(_op: &O, _device: &Device<Self>, _problem: &O::Problem) -> Option<O::Plan> {
        None
    }

    /// Runs `op` on validated input (the checked entry points are the
    /// functions of [`crate::ops`]).
    fn run<O: FusedOp>(op: &O, input: In<O, Self>) -> Out<O, Self> {
        op.composite::<Self>(input)
    }

    /// [`KernelBackend::ask_in_order`] of the kernels under this backend.
    fn ask_in_order<Q: DeviceQuery>(_device: &Device<Self>, _query: &Q) -> Option<Q::Answer> {
        None
    }

    /// [`KernelBackend::run_in_order`] of the kernels under this backend.
    fn run_in_order<K: Kernel>(
        _kernel: &K,
        _floats: Vec<FloatTensor<Self>>,
        _ints: Vec<IntTensor<Self>>,
    ) -> Option<()> {
        None
    }
}

/// Whether `B` runs `op` with kernels for this problem.
pub fn is_fused<B: BastileBackend, O: FusedOp>(
    op: &O,
    device: &Device<B>,
    problem: &O::Problem,
) -> bool {
    B::plan(op, device, problem).is_some()
}

// The plain backends Bastile is compared against: composite everywhere.
impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> BastileBackend
    for CubeBackend<R, F, I, BT>
{
}
impl<B: burn_fusion::FusionBackend> BastileBackend for burn_fusion::Fusion<B> {}
impl BastileBackend for NdArray {}

impl<B: KernelBackend> BastileBackend for Bastile<B> {
    fn plan<O: FusedOp>(op: &O, device: &Device<Self>, problem: &O::Problem) -> Option<O::Plan> {
        if O::PATCH.is_none_or(patches::is_enabled) {
            op.plan::<B>(device, problem)
        } else {
            None
        }
    }

    fn run<O: FusedOp>(op: &O, input: In<O, Self>) -> Out<O, Self> {
        let (device, problem) = op.problem::<B>(&input);
        match Self::plan(op, &device, &problem) {
            Some(plan) => op.kernels::<B>(plan, input),
            None => op.composite::<B>(input),
        }
    }

    fn ask_in_order<Q: DeviceQuery>(device: &Device<Self>, query: &Q) -> Option<Q::Answer> {
        B::ask_in_order(device, query)
    }

    fn run_in_order<K: Kernel>(
        kernel: &K,
        floats: Vec<FloatTensor<Self>>,
        ints: Vec<IntTensor<Self>>,
    ) -> Option<()> {
        B::run_in_order(kernel, floats, ints)
    }
}

impl<B: BastileBackend, C: CheckpointStrategy> BastileBackend for Autodiff<B, C> {
    fn plan<O: FusedOp>(op: &O, device: &Device<Self>, problem: &O::Problem) -> Option<O::Plan> {
        B::plan(op, device, problem)
    }

    fn run<O: FusedOp>(op: &O, input: In<O, Self>) -> Out<O, Self> {
        let (device, problem) = op.problem::<Self>(&input);
        if B::plan(op, &device, &problem).is_some() {
            op.autodiff::<B, C>(input)
        } else {
            op.composite::<Self>(input)
        }
    }

    fn ask_in_order<Q: DeviceQuery>(device: &Device<Self>, query: &Q) -> Option<Q::Answer> {
        B::ask_in_order(device, query)
    }

    fn run_in_order<K: Kernel>(
        kernel: &K,
        floats: Vec<FloatTensor<Self>>,
        ints: Vec<IntTensor<Self>>,
    ) -> Option<()> {
        let floats = floats.into_iter().map(|t| t.primitive).collect();
        B::run_in_order(kernel, floats, ints)
    }
}

/// The kernel dtype for a Burn dtype, if the kernels are built for it.
pub fn kernel_dtype(dtype: DType) -> Option<bastile_cubecl::FloatDtype> {
    match dtype {
        DType::F32 => Some(bastile_cubecl::FloatDtype::F32),
        DType::F16 => Some(bastile_cubecl::FloatDtype::F16),
        DType::BF16 => Some(bastile_cubecl::FloatDtype::BF16),
        _ => None,
    }
}

/// A list of tensors as the array of `N` an op declared (the outputs a
/// kernel returns, the inputs a launch takes).
pub(crate) fn unpack<T, const N: usize>(tensors: Vec<T>) -> [T; N] {
    let count = tensors.len();
    tensors
        .try_into()
        .unwrap_or_else(|_| panic!("expected {N} tensors, got {count}"))
}
