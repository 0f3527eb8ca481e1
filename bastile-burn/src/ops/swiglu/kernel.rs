//! SwiGLU's kernel launches on `CubeBackend`.

use burn::tensor::{DType, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;

use bastile_cubecl::swiglu::{
    self, GluPair, SwiGluBackwardBuffers, SwiGluForwardBuffers, SwiGluProblem,
};

use super::{GluTensors, SwiGlu, SwiGluBackward};
use crate::fused::cube::{as_rows, empty_like, rows_cols, stride_multiple};
use crate::fused::{kernel, kernel_dtype};
use crate::launch_failure::launch;

kernel!(SwiGlu, "bastile_swiglu_forward", |_, mut floats, _| {
    let packed = floats.len() == 1;
    vec![forward(GluTensors::take_from(packed, &mut floats))]
});

kernel!(
    SwiGluBackward,
    "bastile_swiglu_backward",
    |_, mut floats, _| {
        let dout = floats.pop().expect("the output gradient");
        let packed = floats.len() == 1;
        backward(GluTensors::take_from(packed, &mut floats), dout).into_vec()
    }
);

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

/// The launch's problem over the gate/up `pairs` and the `single`
/// matrices beside them (every row stride bounds the vector width).
fn problem(
    rows: usize,
    inter: usize,
    dtype: DType,
    pairs: &[&GluPair],
    single: &[&bastile_cubecl::rows::Rows],
) -> SwiGluProblem {
    let all: Vec<_> = pairs
        .iter()
        .flat_map(|p| pair_rows(p))
        .chain(single.iter().copied())
        .collect();
    SwiGluProblem {
        rows,
        inter,
        dtype: kernel_dtype(dtype).expect("validated dtype"),
        stride_multiple: stride_multiple(inter, &all),
    }
}

fn forward<R: CubeRuntime>(input: GluTensors<CubeTensor<R>>) -> CubeTensor<R> {
    let (input, pair, rows, inter) = lay_out(input);
    let first = input.first();
    let mut shape = first.shape();
    let last = shape.num_dims() - 1;
    shape[last] = inter;
    let (out, out_rows) = as_rows(empty_like(first, shape, first.dtype));
    let problem = problem(rows, inter, first.dtype, &[&pair], &[&out_rows]);
    let buffers = SwiGluForwardBuffers {
        input: pair,
        out: out_rows,
    };
    launch("SwiGLU forward", || {
        swiglu::forward(&first.client, &first.device, &problem, &buffers)
    });
    out
}

fn backward<R: CubeRuntime>(
    input: GluTensors<CubeTensor<R>>,
    dout: CubeTensor<R>,
) -> GluTensors<CubeTensor<R>> {
    // Contiguous activations nobody else holds (the autodiff graph hands
    // over its last reference) are dead after this: their gradients go
    // over them, which saves two `rows × inter` matrices at the backward's
    // peak. Checked before the row views below take references of their
    // own.
    let writable = |t: &CubeTensor<R>| t.can_mut() && t.is_contiguous();
    let in_place = match &input {
        GluTensors::Separate { gate, up } => writable(gate) && writable(up),
        GluTensors::Packed(both) => writable(both),
    };
    let (input, pair, rows, inter) = lay_out(input);
    let (_dout, dout_rows) = as_rows(dout);
    let dtype = input.first().dtype;
    let fresh = |t: &CubeTensor<R>| as_rows(empty_like(t, t.shape(), t.dtype));
    let (grads, grad_pair) = if in_place {
        (input, None)
    } else {
        match &input {
            GluTensors::Separate { gate, up } => {
                let (dg, dg_rows) = fresh(gate);
                let (du, du_rows) = fresh(up);
                (
                    GluTensors::Separate { gate: dg, up: du },
                    Some(GluPair::Separate {
                        gate: dg_rows,
                        up: du_rows,
                    }),
                )
            }
            GluTensors::Packed(both) => {
                let (d, d_rows) = fresh(both);
                (GluTensors::Packed(d), Some(GluPair::Packed(d_rows)))
            }
        }
    };
    let mut pairs = vec![&pair];
    pairs.extend(grad_pair.as_ref());
    let problem = problem(rows, inter, dtype, &pairs, &[&dout_rows]);
    let buffers = SwiGluBackwardBuffers {
        input: pair,
        dout: dout_rows,
        grad: grad_pair,
    };
    let first = grads.first();
    launch("SwiGLU backward", || {
        swiglu::backward(&first.client, &first.device, &problem, &buffers)
    });
    grads
}
