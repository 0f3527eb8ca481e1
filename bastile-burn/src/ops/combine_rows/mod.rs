//! Routed experts' output rows combined per token with the router's
//! weights: the checked entry point, the composite reference and the ops'
//! declarations; the autodiff node in `autodiff.rs`, the kernel launches
//! in `kernel.rs`.
//!
//! Composed of Burn's ops, the combination gathers every choice's row
//! into a `[tokens, top_k, hidden]` copy, weights it and sums over the
//! choices; its backward pass broadcasts the output gradient to that
//! shape, weights it, gathers it back to the rows, and multiplies and
//! reduces once more for the weights: about a millisecond per layer at
//! 8192 tokens and GPT-OSS-20B's width. The kernels
//! (`bastile_cubecl::combine`) read the rows where they are: one pass
//! forward, and one per gradient.

mod autodiff;
mod kernel;

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Int, Shape, Tensor, TensorMetadata};

use crate::fused::{DTypeQuery, In, KernelBackend, Out, TensorSpec, fused_op};
use crate::ops::gather_rows::gather_back;
use crate::ops::{check_float, check_like_input, check_same_device, float};
use crate::patches::Op;
use crate::{BastileBackend, BastileError};

/// Every token's `top_k` chosen rows of `rows`, weighted by `weights` and
/// summed: `out[t] = Σ_j weights[t, j] · rows[row_of_slot[t, j]]`. The
/// fused path multiplies and sums in f32 and rounds once.
///
/// `slot_of_row` must be `row_of_slot`'s inverse: row `r` holds choice
/// `slot_of_row[r]` (`t · top_k + j`), or a value outside the choices
/// (`tokens · top_k`) for a row no choice holds; such a row gets a zero
/// gradient. The indices are not read back from the device: they must lie
/// in range.
///
/// Errors when `rows` is not floating point, `weights` has another dtype
/// or device, or the shapes disagree.
///
/// # Shapes
///
/// - `rows`: `[rows, hidden]`
/// - `weights`, `row_of_slot`: `[tokens, top_k]`
/// - `slot_of_row`: `[rows]`
/// - output: `[tokens, hidden]`, in `rows`' dtype
pub fn combine_rows<B: BastileBackend>(
    rows: Tensor<B, 2>,
    weights: Tensor<B, 2>,
    row_of_slot: Tensor<B, 2, Int>,
    slot_of_row: Tensor<B, 1, Int>,
) -> Result<Tensor<B, 2>, BastileError> {
    let named = "the combined rows";
    check_float(named, rows.dtype())?;
    check_like_input(
        named,
        &rows,
        "the weights",
        weights.dtype(),
        &weights.device(),
    )?;
    if row_of_slot.dims() != weights.dims() || slot_of_row.dims() != [rows.dims()[0]] {
        return Err(BastileError::Shape(format!(
            "combining rows [rows, hidden] takes weights and row_of_slot [tokens, top_k] and \
             slot_of_row [rows], got rows {:?}, weights {:?}, row_of_slot {:?}, slot_of_row {:?}",
            rows.dims(),
            weights.dims(),
            row_of_slot.dims(),
            slot_of_row.dims()
        )));
    }
    check_same_device(named, &rows.device(), "row_of_slot", &row_of_slot.device())?;
    check_same_device(named, &rows.device(), "slot_of_row", &slot_of_row.device())?;
    let input = (
        rows.into_primitive().tensor(),
        weights.into_primitive().tensor(),
        row_of_slot.into_primitive(),
        slot_of_row.into_primitive(),
    );
    Ok(float(B::run(&CombineRows, input)))
}

/// Each choice's row of `rows`, `[tokens, top_k, hidden]`.
fn chosen_rows<B: Backend>(rows: FloatTensor<B>, row_of_slot: IntTensor<B>) -> FloatTensor<B> {
    let hidden = rows.shape()[1];
    let [tokens, top_k] = [row_of_slot.shape()[0], row_of_slot.shape()[1]];
    let flat = B::int_reshape(row_of_slot, Shape::new([tokens * top_k]));
    B::float_reshape(
        B::float_select(rows, 0, flat),
        Shape::new([tokens, top_k, hidden]),
    )
}

/// `weights` `[tokens, top_k]` as `[tokens, top_k, 1]`.
fn per_choice<B: Backend>(weights: FloatTensor<B>) -> FloatTensor<B> {
    let [tokens, top_k] = [weights.shape()[0], weights.shape()[1]];
    B::float_reshape(weights, Shape::new([tokens, top_k, 1]))
}

/// `(rows, weights, row_of_slot, slot_of_row)` to the combined rows.
#[derive(Clone, Copy, Debug, Default)]
pub struct CombineRows;

fused_op! {
    CombineRows: Some(Op::Moe), (F, F, I, I) => F, differentiable,
    |_, (rows, ..)| -> DTypeQuery {
        (B::float_device(rows), DTypeQuery { dtype: rows.dtype() })
    }

    fn composite<B: Backend>(&self, (rows, weights, row_of_slot, _): In<Self, B>) -> Out<Self, B> {
        let hidden = rows.shape()[1];
        let tokens = weights.shape()[0];
        let weighted = B::float_mul(chosen_rows::<B>(rows, row_of_slot), per_choice::<B>(weights));
        B::float_reshape(B::float_sum_dim(weighted, 1), Shape::new([tokens, hidden]))
    }

    fn kernels<K: KernelBackend>(
        &self,
        _: (),
        (rows, weights, row_of_slot, _): In<Self, K>,
    ) -> Out<Self, K> {
        let spec = TensorSpec::new(
            Shape::new([weights.shape()[0], rows.shape()[1]]),
            rows.dtype(),
        );
        // `slot_of_row` is the backward pass's: the forward kernel reads
        // the rows through `row_of_slot` only.
        let mut out = K::launch(self, vec![rows, weights], vec![row_of_slot], vec![spec]);
        out.pop().expect("the combined rows")
    }
}

/// The backward pass, `(rows, weights, dout, row_of_slot, slot_of_row)`
/// to `(drows, dweights)`, each computed only when asked for.
#[derive(Clone, Copy, Debug)]
pub struct CombineRowsBackward {
    pub rows_grad: bool,
    pub weights_grad: bool,
}

fused_op! {
    CombineRowsBackward: Some(Op::Moe), (F, F, F, I, I) => (Option<F>, Option<F>),
    |_, (rows, ..)| -> DTypeQuery {
        (B::float_device(rows), DTypeQuery { dtype: rows.dtype() })
    }

    fn composite<B: Backend>(
        &self,
        (rows, weights, dout, row_of_slot, slot_of_row): In<Self, B>,
    ) -> Out<Self, B> {
        let hidden = rows.shape()[1];
        let [tokens, top_k] = [weights.shape()[0], weights.shape()[1]];
        let dout = B::float_reshape(dout, Shape::new([tokens, 1, hidden]));
        let drows = self.rows_grad.then(|| {
            // Each choice's gradient, gathered back to the row holding it
            // (a row no choice holds names none: a zero gradient).
            let per_slot = B::float_mul(dout.clone(), per_choice::<B>(weights.clone()));
            let per_slot = B::float_reshape(per_slot, Shape::new([tokens * top_k, hidden]));
            let rows_n = slot_of_row.shape()[0];
            gather_back::<B>(per_slot, B::int_reshape(slot_of_row, Shape::new([rows_n, 1])))
        });
        let dweights = self.weights_grad.then(|| {
            let products = B::float_mul(chosen_rows::<B>(rows, row_of_slot), dout);
            B::float_reshape(B::float_sum_dim(products, 2), Shape::new([tokens, top_k]))
        });
        (drows, dweights)
    }

    fn kernels<K: KernelBackend>(
        &self,
        _: (),
        (rows, weights, dout, row_of_slot, slot_of_row): In<Self, K>,
    ) -> Out<Self, K> {
        let mut outputs = vec![];
        if self.rows_grad {
            outputs.push(TensorSpec::of(&rows));
        }
        if self.weights_grad {
            outputs.push(TensorSpec::of(&weights));
        }
        if outputs.is_empty() {
            return (None, None);
        }
        let mut grads = K::launch(
            self,
            vec![rows, weights, dout],
            vec![row_of_slot, slot_of_row],
            outputs,
        )
        .into_iter();
        let drows = self.rows_grad.then(|| grads.next().expect("drows"));
        let dweights = self.weights_grad.then(|| grads.next().expect("dweights"));
        (drows, dweights)
    }
}
