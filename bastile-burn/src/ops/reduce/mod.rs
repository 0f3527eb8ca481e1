//! Sums, means, maxima and minima along one dimension (Burn's `*_dim`
//! ops on `Bastile<B>`, a linear layer's bias gradient, the attention
//! sinks' gradient) and over a whole tensor (`sum`, `mean`, `max`, `min`,
//! in one or two such launches; the loss over its tokens among them), of
//! floats and of ints (the token count, the first out-of-range label),
//! launched with a strategy read off the problem instead of Burn's
//! autotuning.
//!
//! Burn tunes each reduction shape it meets by compiling and timing every
//! strategy it has (up to six kernels per shape, and eight more for a
//! whole sum); the broadcast gradients, softmaxes, expert sums, loss sums
//! and token counts of a model meet a dozen shapes in their first step.
//! Without that tuning a 4-layer GPT-OSS-20B's first training step on a
//! fresh H100 compiles 120 kernels instead of 141 and tunes none, at the
//! same step time. The rule (the kernel's `strategy`) is what Burn's tuner
//! picked on that GPU for the reductions of the models' training steps,
//! and compiles one kernel per shape.

mod kernel;

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;

use crate::fused::{
    DTypeQuery, DeviceQuery, FusedOp, In, KernelBackend, Out, TensorSpec, fused_op, unpack,
};
use crate::{Bastile, BastileBackend};

/// The most elements a whole-tensor reduction takes in one launch of the
/// dimension kernel over the flattened tensor (one cube reduces them, a
/// few microseconds' work).
pub const ONE_LAUNCH_MAX: usize = 1 << 16;

/// The row length of a larger whole-tensor reduction's first launch,
/// which reduces `[n / WHOLE_ROW, WHOLE_ROW]` over its rows (one plane per
/// row, spread over the GPU), the second one reducing those rows' results.
/// Tensors of other sizes, and those of more than `ONE_LAUNCH_MAX` rows,
/// take the backend's own op.
pub const WHOLE_ROW: usize = 1024;

/// How many rows a whole-tensor reduction of `n` elements views the
/// tensor as (a reduction over each row, then one over the rows' results
/// where there is more than one), or `None` where it takes the backend's
/// own op. A sum, mean or maximum of equal rows' sums, means or maxima is
/// the whole one.
pub fn whole_tensor_rows(n: usize) -> Option<usize> {
    if n == 0 {
        None
    } else if n <= ONE_LAUNCH_MAX {
        Some(1)
    } else if n.is_multiple_of(WHOLE_ROW) && n / WHOLE_ROW <= ONE_LAUNCH_MAX {
        Some(n / WHOLE_ROW)
    } else {
        None
    }
}

/// What a [`ReduceDim`] computes over its dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduction {
    Sum,
    Mean,
    Max,
    Min,
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

/// `x` reduced over all its elements into a `[1]` tensor on `Bastile<B>`
/// (Burn's `sum`, `mean`, `max` and `min`), as [`whole_tensor_rows`]
/// says. The kernel paths of other ops call it with their backend.
pub(crate) fn reduce_all<B: KernelBackend>(
    x: FloatTensor<B>,
    reduction: Reduction,
) -> FloatTensor<B> {
    let n = x.shape().num_elements();
    reduce_whole(
        x,
        n,
        B::float_reshape,
        |t, dim| reduce_dim::<Bastile<B>>(t, reduction, dim),
        |t| match reduction {
            Reduction::Sum => B::float_sum(t),
            Reduction::Mean => B::float_mean(t),
            Reduction::Max => B::float_max(t),
            Reduction::Min => B::float_min(t),
        },
    )
}

/// The whole-tensor reduction of `x` (`n` elements, floats or ints) as
/// [`whole_tensor_rows`] says: `along` a dimension on rows of the
/// `reshape`d tensor, then along the rows' results, or the backend's
/// `own` op.
fn reduce_whole<T>(
    x: T,
    n: usize,
    reshape: impl Fn(T, Shape) -> T,
    along: impl Fn(T, usize) -> T,
    own: impl FnOnce(T) -> T,
) -> T {
    let Some(rows) = whole_tensor_rows(n) else {
        return own(x);
    };
    let by_row = reshape(x, Shape::new([rows, n / rows]));
    let row_results = reshape(along(by_row, 1), Shape::new([rows]));
    if rows == 1 {
        row_results
    } else {
        along(row_results, 0)
    }
}

/// The ints `x` reduced over `dim` (kept with size 1), as Burn's
/// `int_sum_dim`, `int_max_dim` and `int_min_dim`, on `Bastile<B>`.
pub(crate) fn int_reduce_dim<B: KernelBackend>(
    x: IntTensor<B>,
    reduction: Reduction,
    dim: usize,
) -> IntTensor<B> {
    Bastile::<B>::run(&IntReduceDim { reduction, dim }, x)
}

/// The ints `x` reduced over all their elements into a `[1]` tensor, as
/// Burn's `int_sum`, `int_max` and `int_min`, on `Bastile<B>`, as
/// [`whole_tensor_rows`] says.
pub(crate) fn int_reduce_all<B: KernelBackend>(
    x: IntTensor<B>,
    reduction: Reduction,
) -> IntTensor<B> {
    let n = x.shape().num_elements();
    reduce_whole(
        x,
        n,
        B::int_reshape,
        |t, dim| int_reduce_dim::<B>(t, reduction, dim),
        |t| match reduction {
            Reduction::Sum => B::int_sum(t),
            Reduction::Mean => B::int_mean(t),
            Reduction::Max => B::int_max(t),
            Reduction::Min => B::int_min(t),
        },
    )
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
            Reduction::Min => B::float_min_dim(x, self.dim),
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

/// Ints reduced along one dimension, which keeps size 1 (Burn's
/// `int_*_dim` ops): token counts, the first flagged label. A mean of ints
/// truncates, as Burn's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IntReduceDim {
    pub reduction: Reduction,
    pub dim: usize,
}

/// Whether the device computes in `dtype` (any element type, ints
/// included).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StorageQuery {
    pub dtype: DType,
}

impl DeviceQuery for StorageQuery {
    type Answer = bool;

    fn ask<R: CubeRuntime>(&self, device: &R::Device) -> bool {
        R::client(device)
            .properties()
            .supports_type(cubecl::ir::StorageType::from(self.dtype))
    }
}

fused_op! {
    IntReduceDim: None, I => I,
    |_, x| -> StorageQuery {
        (B::int_device(x), StorageQuery { dtype: x.dtype() })
    }

    fn composite<B: Backend>(&self, x: In<Self, B>) -> Out<Self, B> {
        match self.reduction {
            Reduction::Sum => B::int_sum_dim(x, self.dim),
            Reduction::Mean => B::int_mean_dim(x, self.dim),
            Reduction::Max => B::int_max_dim(x, self.dim),
            Reduction::Min => B::int_min_dim(x, self.dim),
        }
    }

    fn kernels<K: KernelBackend>(&self, _: (), x: In<Self, K>) -> Out<Self, K> {
        let mut dims = x.shape().to_vec();
        dims[self.dim] = 1;
        let out = TensorSpec::new(Shape::from(dims), x.dtype());
        let [y] = unpack(K::launch_ints(self, vec![x], vec![out]));
        y
    }
}
