//! The linear layer's passes on `CubeBackend`, each one custom op of a
//! fusion stream: the views of the input and output are metadata here
//! (rows of a pitched input too), and
//! the products run on cuBLASLt where it takes them, on CubeCL's matmul
//! elsewhere.

use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{DType, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use super::{LinearBackward, Passes, backward, is_batched, without_rows};
use crate::Bastile;
use crate::backend::matmul::{matmul_with_bias, product, product_and_column_sums, with_columns};
use crate::fused::cube::rows_view;
use crate::fused::kernel;
use crate::ops::reduce::{Reduction, reduce_dim};

type Cube<R, F, I, BT> = CubeBackend<R, F, I, BT>;

fn cube_product<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    lhs: CubeTensor<R>,
    rhs: CubeTensor<R>,
    dtype: DType,
) -> CubeTensor<R> {
    product::<R, F, I, BT>(&lhs, &rhs, 1.0, dtype, None)
}

/// Each matrix's column sums with the fixed-strategy reduction kernel
/// (Burn's would tune each shape).
fn cube_column_sums<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    t: CubeTensor<R>,
) -> CubeTensor<R> {
    let shape = t.shape();
    let summed = reduce_dim::<Bastile<Cube<R, F, I, BT>>>(t, Reduction::Sum, shape.num_dims() - 2);
    Cube::<R, F, I, BT>::float_reshape(summed, without_rows(shape))
}

/// The forward pass. Inputs: `x, weight, bias?`; output: `y`.
#[derive(Clone, Copy, Debug)]
pub(super) struct LinearForward {
    pub has_bias: bool,
}

kernel!(LinearForward, "bastile_linear_forward", |op, floats, _| {
    let mut floats = floats.into_iter();
    let x = floats.next().expect("the input");
    let weight = floats.next().expect("the weight");
    let bias = op.has_bias.then(|| floats.next().expect("the bias"));
    if is_batched::<Cube<R, F, I, BT>>(&weight) {
        return vec![matmul_with_bias::<R, F, I, BT>(x, weight, bias)];
    }
    let shape = with_columns(x.shape(), weight.shape()[1]);
    let y = matmul_with_bias::<R, F, I, BT>(rows_view(x), weight, bias);
    vec![Cube::<R, F, I, BT>::float_reshape(y, shape)]
});

/// The backward pass. Inputs: `x, weight, dy`; outputs: `dx`, `dW` and
/// `dbias`, as asked for.
#[derive(Clone, Copy, Debug)]
pub(super) struct LinearBackwardKernel {
    pub op: LinearBackward,
}

kernel!(
    LinearBackwardKernel,
    "bastile_linear_backward",
    |k, floats, _| {
        let [x, weight, dy] = crate::fused::unpack(floats);
        let passes = Passes {
            product: cube_product::<R, F, I, BT>,
            product_and_sums: product_and_column_sums::<R>,
            column_sums: cube_column_sums::<R, F, I, BT>,
            rows: rows_view::<R>,
        };
        let (dx, dw, dbias) = backward::<Cube<R, F, I, BT>>(&k.op, (x, weight, dy), passes);
        dx.into_iter().chain(dw).chain(dbias).collect()
    }
);
