//! The linear layer's passes on `CubeBackend`, each one custom op of a
//! fusion stream: the views of the input and output are metadata here
//! (rows of a pitched input too), and
//! the products run on cuBLASLt where it takes them, on CubeCL's matmul
//! elsewhere.

use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{DType, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use super::{LinearBackward, backward};
use crate::backend::matmul::{matmul_with_bias, product, with_columns};
use crate::fused::cube::rows_view;
use crate::fused::kernel;

type Cube<R, F, I, BT> = CubeBackend<R, F, I, BT>;

fn cube_product<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    lhs: CubeTensor<R>,
    rhs: CubeTensor<R>,
    dtype: DType,
) -> CubeTensor<R> {
    product::<R, F, I, BT>(&lhs, &rhs, 1.0, dtype, None)
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
    let shape = with_columns(x.shape(), weight.shape()[1]);
    let y = matmul_with_bias::<R, F, I, BT>(rows_view(x), weight, bias);
    vec![Cube::<R, F, I, BT>::float_reshape(y, shape)]
});

/// The backward pass. Inputs: `x, weight, dy`; outputs: `dx` and `dW`, as
/// asked for.
#[derive(Clone, Copy, Debug)]
pub(super) struct LinearBackwardKernel {
    pub op: LinearBackward,
}

kernel!(
    LinearBackwardKernel,
    "bastile_linear_backward",
    |k, floats, _| {
        let [x, weight, dy] = crate::fused::unpack(floats);
        let (dx, dw) = backward::<Cube<R, F, I, BT>>(
            &k.op,
            (x, weight, dy),
            cube_product::<R, F, I, BT>,
            rows_view::<R>,
        );
        dx.into_iter().chain(dw).collect()
    }
);
