//! SwiGLU on `CubeBackend`.

use burn::tensor::TensorMetadata;
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;

use bastile_cubecl::swiglu::{
    self, GluPair, SwiGluBackwardBuffers, SwiGluForwardBuffers, SwiGluProblem,
};

use super::{as_rows, empty_like, rows_cols, stride_multiple};
use crate::kernels::kernel_dtype;
use crate::ops::swiglu::GluTensors;

/// The input as row matrices, its `(rows, inter)` and the tensors to keep
/// alive during the launch.
fn lay_out<R: CubeRuntime>(
    input: GluTensors<CubeTensor<R>>,
) -> (GluTensors<CubeTensor<R>>, GluPair, usize, usize) {
    match input {
        GluTensors::Separate { gate, up } => {
            let (gate, g) = as_rows(gate);
            let (up, u) = as_rows(up);
            let (rows, inter) = rows_cols(&gate.shape());
            (
                GluTensors::Separate { gate, up },
                GluPair::Separate { gate: g, up: u },
                rows,
                inter,
            )
        }
        GluTensors::Packed(both) => {
            let (both, b) = as_rows(both);
            let (rows, width) = rows_cols(&both.shape());
            (
                GluTensors::Packed(both),
                GluPair::Packed(b),
                rows,
                width / 2,
            )
        }
    }
}

fn pair_rows(pair: &GluPair) -> Vec<&bastile_cubecl::rows::Rows> {
    match pair {
        GluPair::Separate { gate, up } => vec![gate, up],
        GluPair::Packed(both) => vec![both],
    }
}

pub(super) fn forward<R: CubeRuntime>(input: GluTensors<CubeTensor<R>>) -> CubeTensor<R> {
    let (input, pair, rows, inter) = lay_out(input);
    let first = input.first();
    let mut shape = first.shape();
    let last = shape.num_dims() - 1;
    shape[last] = inter;
    let (out, out_rows) = as_rows(empty_like(first, shape, first.dtype));
    let mut all = pair_rows(&pair);
    all.push(&out_rows);
    let problem = SwiGluProblem {
        rows,
        inter,
        dtype: kernel_dtype(first.dtype).expect("validated dtype"),
        stride_multiple: stride_multiple(inter, &all),
    };
    let buffers = SwiGluForwardBuffers {
        input: pair,
        out: out_rows,
    };
    swiglu::forward(&first.client, &first.device, &problem, &buffers)
        .unwrap_or_else(|e| panic!("SwiGLU forward launch after a positive support check: {e}"));
    out
}

pub(super) fn backward<R: CubeRuntime>(
    input: GluTensors<CubeTensor<R>>,
    dout: CubeTensor<R>,
) -> GluTensors<CubeTensor<R>> {
    let (input, pair, rows, inter) = lay_out(input);
    let (_dout, dout_rows) = as_rows(dout);
    let first = input.first();
    let fresh = |t: &CubeTensor<R>| as_rows(empty_like(t, t.shape(), t.dtype));
    let (grads, grad_pair) = match &input {
        GluTensors::Separate { gate, up } => {
            let (dg, dg_rows) = fresh(gate);
            let (du, du_rows) = fresh(up);
            (
                GluTensors::Separate { gate: dg, up: du },
                GluPair::Separate {
                    gate: dg_rows,
                    up: du_rows,
                },
            )
        }
        GluTensors::Packed(both) => {
            let (d, d_rows) = fresh(both);
            (GluTensors::Packed(d), GluPair::Packed(d_rows))
        }
    };
    let mut all = pair_rows(&pair);
    all.extend(pair_rows(&grad_pair));
    all.push(&dout_rows);
    let problem = SwiGluProblem {
        rows,
        inter,
        dtype: kernel_dtype(first.dtype).expect("validated dtype"),
        stride_multiple: stride_multiple(inter, &all),
    };
    let buffers = SwiGluBackwardBuffers {
        input: pair,
        dout: dout_rows,
        grad: grad_pair,
    };
    swiglu::backward(&first.client, &first.device, &problem, &buffers)
        .unwrap_or_else(|e| panic!("SwiGLU backward launch after a positive support check: {e}"));
    grads
}
