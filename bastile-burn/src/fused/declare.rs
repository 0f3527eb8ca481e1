//! The two macros an op's folder declares itself with, so that the
//! signatures of [`FusedOp`](super::FusedOp) and [`Kernel`](super::Kernel)
//! are written once, here.

/// Implements [`Kernel`](crate::fused::Kernel) for an op value:
///
/// ```text
/// kernel!(RmsNorm, "bastile_rms_norm_forward", |op, floats, _ints| {
///     let [x, gamma] = unpack(floats);
///     ...
/// });
/// ```
///
/// `kernel!(Op, "name", dispatch_at_once: true, |..| ..)` sets
/// [`Kernel::DISPATCH_AT_ONCE`](crate::fused::Kernel::DISPATCH_AT_ONCE).
/// The body sees the op value, the float and int input lists (bound by the
/// patterns) and the generic parameters `R`, `F`, `I`, `BT` of the
/// `CubeBackend` it launches on, and returns the outputs in order.
macro_rules! kernel {
    ($op:ty, $name:literal, |$this:pat_param, $floats:pat_param, $ints:pat_param| $body:expr) => {
        $crate::fused::kernel!($op, $name, dispatch_at_once: false, |$this, $floats, $ints| $body);
    };
    (
        $op:ty, $name:literal, dispatch_at_once: $at_once:literal,
        |$this:pat_param, $floats:pat_param, $ints:pat_param| $body:expr
    ) => {
        impl $crate::fused::Kernel for $op {
            const NAME: &'static str = $name;
            const DISPATCH_AT_ONCE: bool = $at_once;

            fn launch<
                R: burn_cubecl::CubeRuntime,
                F: burn_cubecl::FloatElement,
                I: burn_cubecl::IntElement,
                BT: burn_cubecl::BoolElement,
            >(
                &self,
                floats: Vec<burn_cubecl::tensor::CubeTensor<R>>,
                ints: Vec<burn_cubecl::tensor::CubeTensor<R>>,
            ) -> Vec<burn_cubecl::tensor::CubeTensor<R>> {
                let $this = self;
                let $floats = floats;
                let $ints = ints;
                $body
            }
        }
    };
}

/// Implements [`FusedOp`](crate::fused::FusedOp) for an op whose kernels
/// have no choice to make (its plan is `()`): they run when the device
/// answers yes to the op's query.
///
/// ```text
/// fused_op! {
///     RmsNorm: Some(Op::RmsNorm), (F, F) => (F, F),
///     |_, (x, _)| -> RmsNormQuery { problem_of::<B>(x) }
///
///     fn composite<B: Backend>(&self, input: In<Self, B>) -> Out<Self, B> { .. }
///     fn kernels<K: KernelBackend>(&self, _: (), input: In<Self, K>) -> Out<Self, K> { .. }
/// }
/// ```
///
/// The header gives the patch switch, the input and output (in the tensor
/// types `F` and `I`), optionally `differentiable` (the op records the
/// node of its folder's `autodiff::forward` on `Autodiff<B>`), and how the
/// input gives its device and query (the body sees the backend `B`); the
/// rest of the impl follows it.
macro_rules! fused_op {
    // `differentiable` after the output: on `Autodiff<B>` the op is the
    // node that the op folder's `autodiff::forward(op, input)` records.
    (
        $op:ty: $patch:expr, $input:ty => $output:ty, differentiable,
        |$this:pat_param, $tensors:pat_param| -> $query:ty $problem:block
        $($items:tt)*
    ) => {
        $crate::fused::fused_op! {
            $op: $patch, $input => $output,
            |$this, $tensors| -> $query $problem

            fn autodiff<B: $crate::BastileBackend, C: burn_autodiff::checkpoint::strategy::CheckpointStrategy>(
                &self,
                input: $crate::fused::In<Self, burn_autodiff::Autodiff<B, C>>,
            ) -> $crate::fused::Out<Self, burn_autodiff::Autodiff<B, C>> {
                autodiff::forward::<B, C>(self, input)
            }

            $($items)*
        }
    };
    (
        $op:ty: $patch:expr, $input:ty => $output:ty,
        |$this:pat_param, $tensors:pat_param| -> $query:ty $problem:block
        $($items:tt)*
    ) => {
        impl $crate::fused::FusedOp for $op {
            const PATCH: Option<$crate::Op> = $patch;
            type Input<F, I> = $input;
            type Output<F, I> = $output;
            type Problem = $query;
            type Plan = ();

            fn problem<B: burn::tensor::backend::Backend>(
                &self,
                input: &$crate::fused::In<Self, B>,
            ) -> (burn::tensor::Device<B>, $query) {
                let $this = self;
                let $tensors = input;
                $problem
            }

            fn plan<K: $crate::fused::KernelBackend>(
                &self,
                device: &burn::tensor::Device<K>,
                query: &$query,
            ) -> Option<()> {
                $crate::fused::supported::<K, _>(device, query)
            }

            $($items)*
        }
    };
}

pub(crate) use {fused_op, kernel};
