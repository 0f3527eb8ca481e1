//! Rows gathered by an index the caller can invert: the checked entry
//! point, the reference math and the ops' declarations; the autodiff node
//! in `autodiff.rs`, the backward kernel's launch in `kernel.rs`.
//!
//! Routed experts copy each token's row once per expert that chose it and
//! gather the experts' output rows back in token order. Burn's `select`
//! does the gathering, but its backward pass is `select_assign`, which
//! walks every gathered row in one unit per column: tens of thousands of
//! rows one after another. The caller knows where each row went, so it
//! also hands over the inverse (for every source row, the output rows that
//! copy it), and the backward pass gathers those rows' gradients and sums
//! them: both passes are gathers, parallel over every element, the
//! backward one kernel ([`GatherRowsBack`]).

mod autodiff;
mod kernel;

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Int, Shape, Tensor, TensorMetadata};

use crate::fused::{DTypeQuery, In, KernelBackend, Out, TensorSpec, fused_op};
use crate::ops::{check_float, check_same_device, float};
use crate::patches::Op;
use crate::{BastileBackend, BastileError};

/// The rows of `x` at `index`, whose gradient is gathered back through
/// `sources`: for every row of `x`, the output rows that copy it, padded
/// with `index`'s length (no row).
///
/// `sources` must be `index`'s inverse: output row `o` copies row `r`
/// exactly when `o` is in `sources[r]`. The indices are not read back from
/// the device: they must lie in range. An output row that no entry of
/// `sources` names (one padding a group) must get a zero gradient: the
/// fused node drops it, the composite path (Burn's `select`) passes it on.
///
/// Errors when `x` is not floating point, `sources` has another number of
/// rows than `x`, or the tensors are on different devices.
///
/// # Shapes
///
/// - `x`: `[rows, hidden]`
/// - `index`: `[out_rows]`
/// - `sources`: `[rows, copies]`
/// - output: `[out_rows, hidden]`, in `x`'s dtype
pub fn gather_rows<B: BastileBackend>(
    x: Tensor<B, 2>,
    index: Tensor<B, 1, Int>,
    sources: Tensor<B, 2, Int>,
) -> Result<Tensor<B, 2>, BastileError> {
    check_float("the gathered rows", x.dtype())?;
    let [rows, _] = x.dims();
    if sources.dims()[0] != rows {
        return Err(BastileError::Shape(format!(
            "gathering rows of x {:?} takes sources [rows, copies] with a row per row of x, \
             got sources {:?}",
            x.dims(),
            sources.dims()
        )));
    }
    check_same_device("the gathered rows", &x.device(), "index", &index.device())?;
    check_same_device(
        "the gathered rows",
        &x.device(),
        "sources",
        &sources.device(),
    )?;
    let input = (
        x.into_primitive().tensor(),
        index.into_primitive(),
        sources.into_primitive(),
    );
    Ok(float(B::run(&GatherRows, input)))
}

/// The gradient of gathered rows: for every source row, the sum of the
/// rows of `dout` that `sources` names (entries equal to `dout`'s row
/// count name a zero row appended to it).
pub(crate) fn gather_back<B: Backend>(
    dout: FloatTensor<B>,
    sources: IntTensor<B>,
) -> FloatTensor<B> {
    let hidden = dout.shape()[1];
    let [rows, copies] = [sources.shape()[0], sources.shape()[1]];
    let zero = B::float_zeros(
        Shape::new([1, hidden]),
        &B::float_device(&dout),
        dout.dtype().into(),
    );
    let padded = B::float_cat(vec![dout, zero], 0);
    let flat = B::int_reshape(sources, Shape::new([rows * copies]));
    let picked = B::float_select(padded, 0, flat);
    if copies == 1 {
        return picked;
    }
    let picked = B::float_reshape(picked, Shape::new([rows, copies, hidden]));
    B::float_reshape(B::float_sum_dim(picked, 1), Shape::new([rows, hidden]))
}

/// `(dout, sources)` to the gathered rows' gradient: for every row of
/// `sources`, the sum of the rows of `dout` its entries name (an entry
/// equal to `dout`'s row count names none). One kernel on `CubeBackend`,
/// where the composite concatenates a zero row to `dout` (a copy of it),
/// gathers every entry's row and sums them.
#[derive(Clone, Copy, Debug, Default)]
pub struct GatherRowsBack;

fused_op! {
    GatherRowsBack: Some(Op::Moe), (F, I) => F,
    |_, (dout, _)| -> DTypeQuery {
        (B::float_device(dout), DTypeQuery { dtype: dout.dtype() })
    }

    fn composite<B: Backend>(&self, (dout, sources): In<Self, B>) -> Out<Self, B> {
        gather_back::<B>(dout, sources)
    }

    fn kernels<K: KernelBackend>(&self, _: (), (dout, sources): In<Self, K>) -> Out<Self, K> {
        let [rows, hidden] = [sources.shape()[0], dout.shape()[1]];
        let spec = TensorSpec::new(Shape::new([rows, hidden]), dout.dtype());
        let mut out = K::launch(self, vec![dout], vec![sources], vec![spec]);
        out.pop().expect("the gradient")
    }
}

/// `(x, index, sources)` to the rows of `x` at `index`.
#[derive(Clone, Copy, Debug, Default)]
pub struct GatherRows;

fused_op! {
    GatherRows: Some(Op::Moe), (F, I, I) => F, differentiable,
    |_, (x, _, _)| -> DTypeQuery {
        (B::float_device(x), DTypeQuery { dtype: x.dtype() })
    }

    fn composite<B: Backend>(&self, (x, index, _): In<Self, B>) -> Out<Self, B> {
        B::float_select(x, 0, index)
    }

    fn kernels<K: KernelBackend>(&self, _: (), (x, index, _): In<Self, K>) -> Out<Self, K> {
        K::float_select(x, 0, index)
    }
}
