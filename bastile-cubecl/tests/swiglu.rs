//! SwiGLU kernels against the f64 reference: every tile candidate, the
//! autotuned entry points, separate and packed (gate | up) inputs and
//! gradients, gradients written over the input, padded row pitches,
//! NaN-poisoned outputs and padding.

use bastile_cubecl::elementwise::TileLaunch;
use bastile_cubecl::launch::gcd;
use bastile_cubecl::reference::swiglu as reference;
use bastile_cubecl::rows::Rows;
use bastile_cubecl::swiglu::{
    self, GluPair, SwiGluBackwardBuffers, SwiGluForwardBuffers, SwiGluProblem,
};
use bastile_cubecl::testing::*;
use bastile_cubecl::{FloatDtype, KernelError};
use cubecl::prelude::*;

/// How a case lays out its matrices.
#[derive(Clone, Copy, Debug)]
struct Layout {
    packed_in: bool,
    /// Ignored in place: the gradients take the input's layout.
    packed_grad: bool,
    /// The gradients written over the input (`grad: None`).
    in_place: bool,
    /// Extra elements at the end of every row (NaN, never to be touched).
    pad: usize,
}

/// Interleaves rows of gate and up into rows of `[gate | up]`.
fn pack(gate: &[f64], up: &[f64], inter: usize) -> Vec<f64> {
    gate.chunks(inter)
        .zip(up.chunks(inter))
        .flat_map(|(g, u)| g.iter().chain(u).copied())
        .collect::<Vec<_>>()
}

fn unpack(both: &[f64], inter: usize) -> (Vec<f64>, Vec<f64>) {
    let mut g = Vec::new();
    let mut u = Vec::new();
    for row in both.chunks(2 * inter) {
        g.extend_from_slice(&row[..inter]);
        u.extend_from_slice(&row[inter..]);
    }
    (g, u)
}

#[allow(clippy::too_many_arguments)]
fn check<R: Runtime>(
    client: &ComputeClient<R>,
    device: &R::Device,
    rows: usize,
    inter: usize,
    dtype: FloatDtype,
    layout: Layout,
    config: Option<&TileLaunch>,
    rng: &mut Rng,
) {
    let seed = rng.seed();
    let what = format!("rows {rows} inter {inter} {dtype} {layout:?} {config:?} seed {seed}");
    let gate = rounded(rng, dtype, rows * inter, 3.0);
    let up = rounded(rng, dtype, rows * inter, 1.0);
    let dout = rounded(rng, dtype, rows * inter, 1.0);
    let round = |v| round_to(dtype, v);
    let out_ref = reference::forward(&gate, &up, round);
    let (dg_ref, du_ref) = reference::backward(&gate, &up, &dout, round);

    let pad = layout.pad;
    let single = inter + pad;
    let double = 2 * inter + pad;
    let matrix = |values: &[f64], width: usize, stride: usize| Rows {
        handle: upload(client, dtype, &pad_rows(values, width, stride)),
        stride,
    };
    let poison = |stride: usize| Rows {
        handle: poisoned(client, dtype, rows * stride),
        stride,
    };
    let input = if layout.packed_in {
        GluPair::Packed(matrix(&pack(&gate, &up, inter), 2 * inter, double))
    } else {
        GluPair::Separate {
            gate: matrix(&gate, inter, single),
            up: matrix(&up, inter, single),
        }
    };
    let problem = SwiGluProblem {
        rows,
        inter,
        dtype,
        stride_multiple: [single, double].into_iter().fold(inter, gcd),
    };

    let fwd = SwiGluForwardBuffers {
        input: input.clone(),
        out: poison(single),
    };
    match config {
        Some(c) => swiglu::forward_with(client, &problem, &fwd, c).unwrap(),
        None => swiglu::forward(client, device, &problem, &fwd).unwrap(),
    }
    let out = unpad_rows(
        download(client, dtype, fwd.out.handle.clone()),
        inter,
        single,
        &what,
    );
    assert_close(
        &format!("out {what}"),
        &out,
        &out_ref,
        tolerance(dtype),
        seed,
    );

    let grad = if layout.in_place {
        None
    } else if layout.packed_grad {
        Some(GluPair::Packed(poison(double)))
    } else {
        Some(GluPair::Separate {
            gate: poison(single),
            up: poison(single),
        })
    };
    let bwd = SwiGluBackwardBuffers {
        input,
        dout: matrix(&dout, inter, single),
        grad,
    };
    match config {
        Some(c) => swiglu::backward_with(client, &problem, &bwd, c).unwrap(),
        None => swiglu::backward(client, device, &problem, &bwd).unwrap(),
    }
    let (dg, du) = match bwd.grad.as_ref().unwrap_or(&bwd.input) {
        GluPair::Packed(both) => unpack(
            &unpad_rows(
                download(client, dtype, both.handle.clone()),
                2 * inter,
                double,
                &what,
            ),
            inter,
        ),
        GluPair::Separate { gate, up } => (
            unpad_rows(
                download(client, dtype, gate.handle.clone()),
                inter,
                single,
                &what,
            ),
            unpad_rows(
                download(client, dtype, up.handle.clone()),
                inter,
                single,
                &what,
            ),
        ),
    };
    assert_close_to_size(
        &format!("d_gate (error over its terms' size) {what}"),
        &dg,
        &dg_ref,
        &reference::d_gate_size(&gate, &up, &dout, &dg_ref),
        tolerance(dtype),
        seed,
    );
    assert_close(
        &format!("d_up {what}"),
        &du,
        &du_ref,
        tolerance(dtype),
        seed,
    );
}

const LAYOUTS: [Layout; 6] = [
    Layout {
        packed_in: false,
        packed_grad: false,
        in_place: false,
        pad: 0,
    },
    Layout {
        packed_in: true,
        packed_grad: true,
        in_place: false,
        pad: 0,
    },
    Layout {
        packed_in: true,
        packed_grad: true,
        in_place: true,
        pad: 0,
    },
    Layout {
        packed_in: true,
        packed_grad: false,
        in_place: false,
        pad: 8,
    },
    Layout {
        packed_in: false,
        packed_grad: false,
        in_place: true,
        pad: 5,
    },
    Layout {
        packed_in: false,
        packed_grad: true,
        in_place: false,
        pad: 3,
    },
];

/// Every tile candidate on one shape, every layout.
struct EveryCandidate;

impl RuntimeTest for EveryCandidate {
    fn run<R: Runtime>(&self, device: &R::Device, runtime: &str, dtypes: &[FloatDtype]) {
        let client = R::client(device);
        let mut rng = Rng::fresh();
        for dtype in supported_dtypes(&client, dtypes) {
            let (rows, inter) = (37, 136);
            let problem = SwiGluProblem {
                rows,
                inter,
                dtype,
                stride_multiple: inter,
            };
            let candidates = swiglu::candidates(&client, &problem);
            assert!(candidates.len() >= 3, "{runtime}: {candidates:?}");
            for c in &candidates {
                for layout in [LAYOUTS[0], LAYOUTS[1], LAYOUTS[2]] {
                    check(
                        &client,
                        device,
                        rows,
                        inter,
                        dtype,
                        layout,
                        Some(c),
                        &mut rng,
                    );
                }
            }
        }
    }
}

#[test]
fn swiglu_every_candidate_matches_reference() {
    for_each_runtime(&EveryCandidate);
}

/// The autotuned entry points over odd and model-sized shapes.
struct ShapeGrid;

impl RuntimeTest for ShapeGrid {
    fn run<R: Runtime>(&self, device: &R::Device, _runtime: &str, dtypes: &[FloatDtype]) {
        let client = R::client(device);
        let mut rng = Rng::fresh();
        for dtype in supported_dtypes(&client, dtypes) {
            for (i, (rows, inter)) in [
                (1usize, 1usize),
                (3, 37),
                (129, 1000),
                (9, 2880),
                (5, 3072),
                (2, 12288),
                (3, 14336),
            ]
            .into_iter()
            .enumerate()
            {
                check(
                    &client,
                    device,
                    rows,
                    inter,
                    dtype,
                    LAYOUTS[i % LAYOUTS.len()],
                    None,
                    &mut rng,
                );
            }
        }
    }
}

#[test]
fn swiglu_autotuned_matches_reference_on_odd_and_model_shapes() {
    for_each_runtime(&ShapeGrid);
}

/// Degenerate problems are errors, not launches.
struct Rejects;

impl RuntimeTest for Rejects {
    fn run<R: Runtime>(&self, device: &R::Device, _runtime: &str, _dtypes: &[FloatDtype]) {
        let client = R::client(device);
        let problem = SwiGluProblem {
            rows: 2,
            inter: 0,
            dtype: FloatDtype::F32,
            stride_multiple: 1,
        };
        let buffers = SwiGluForwardBuffers {
            input: GluPair::Packed(Rows::dense(client.empty(64), 4)),
            out: Rows::dense(client.empty(64), 4),
        };
        let err = swiglu::forward(&client, device, &problem, &buffers).unwrap_err();
        assert!(matches!(err, KernelError::Shape(_)), "{err}");
    }
}

#[test]
fn swiglu_rejects_empty_rows() {
    for_each_runtime(&Rejects);
}
