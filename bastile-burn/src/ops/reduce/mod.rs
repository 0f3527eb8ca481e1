//! Sums, means and maxima along one dimension (Burn's `sum_dim`,
//! `mean_dim` and `max_dim` on `Bastile<B>`, a linear layer's bias
//! gradient, the attention sinks' gradient), launched with a strategy read
//! off the problem instead of Burn's autotuning.
//!
//! Burn tunes each reduction shape it meets by compiling and timing every
//! strategy it has (up to six kernels per shape); the broadcast gradients,
//! softmaxes and expert sums of a model meet a dozen shapes in their first
//! step. Without that tuning a 4-layer GPT-OSS-20B's first training step on
//! a fresh H100 ends 3.7 s sooner (26.4 s against 22.7 s), at the same step
//! time. The rule (the kernel's `strategy`) is what Burn's tuner picked on
//! that GPU for the reductions of the models' training steps, and compiles
//! one kernel per shape.

mod kernel;

use burn::tensor::Shape;
use burn::tensor::TensorMetadata;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;

use crate::BastileBackend;
use crate::fused::{DTypeQuery, FusedOp, In, KernelBackend, Out, TensorSpec, fused_op, unpack};

/// What a [`ReduceDim`] computes over its dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduction {
    Sum,
    Mean,
    Max,
}

/// `x` reduced over `dim`, which keeps size 1 (as Burn's `*_dim` ops).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReduceDim {
    pub reduction: Reduction,
    pub dim: usize,
}

/// `x` reduced over `dim` on `B`: the fixed-strategy kernel where `B` runs
/// CubeCL kernels for `x`'s dtype, else `B`'s own op.
///
/// # Shapes
///
/// - `x`: any, with `dim` < its rank
/// - output: `x`'s, with `dim` of size 1, in `x`'s dtype
pub(crate) fn reduce_dim<B: BastileBackend>(
    x: FloatTensor<B>,
    reduction: Reduction,
    dim: usize,
) -> FloatTensor<B> {
    B::run(&ReduceDim { reduction, dim }, x)
}

/// `x` reduced over `dim` by the kernel on `K`, for the kernel paths of
/// other ops (whose tensors are in kernel dtypes).
pub(crate) fn reduce_dim_kernel<K: KernelBackend>(
    x: FloatTensor<K>,
    reduction: Reduction,
    dim: usize,
) -> FloatTensor<K> {
    ReduceDim { reduction, dim }.kernels::<K>((), x)
}

fused_op! {
    ReduceDim: None, F => F,
    |_, x| -> DTypeQuery {
        (B::float_device(x), DTypeQuery { dtype: x.dtype() })
    }

    fn composite<B: Backend>(&self, x: In<Self, B>) -> Out<Self, B> {
        match self.reduction {
            Reduction::Sum => B::float_sum_dim(x, self.dim),
            Reduction::Mean => B::float_mean_dim(x, self.dim),
            Reduction::Max => B::float_max_dim(x, self.dim),
        }
    }

    fn kernels<K: KernelBackend>(&self, _: (), x: In<Self, K>) -> Out<Self, K> {
        let mut dims = x.shape().to_vec();
        dims[self.dim] = 1;
        let out = TensorSpec::new(Shape::from(dims), x.dtype());
        let [y] = unpack(K::launch(self, vec![x], vec![], vec![out]));
        y
    }
}
