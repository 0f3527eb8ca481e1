//! GPT-OSS clamped GEGLU kernels against the f64 reference: every tile
//! candidate, the autotuned entry points, padded row pitches, poisoned
//! outputs, and the clamp boundaries (exactly ±limit, just past, far past).

use bastile_cubecl::elementwise::TileLaunch;
use bastile_cubecl::geglu::{self, GegluBackwardBuffers, GegluForwardBuffers, GegluProblem};
use bastile_cubecl::launch::gcd;
use bastile_cubecl::reference::geglu as reference;
use bastile_cubecl::rows::Rows;
use bastile_cubecl::testing::*;
use bastile_cubecl::{FloatDtype, KernelError};
use cubecl::prelude::*;

const ALPHA: f32 = 1.702;
const LIMIT: f32 = 7.0;

/// Random interleaved (gate, up) rows wide enough to cross the clamps, with
/// the boundary values planted at fixed spots of each row.
fn input(rng: &mut Rng, dtype: FloatDtype, rows: usize, inter: usize) -> Vec<f64> {
    let limit = LIMIT as f64;
    // The gate is only clamped from above: a large negative gate is a plain
    // input (and overflows f16 products in the eager reference too).
    let gate_specials = [limit, limit + 0.5, 1e4, limit - 0.25, -limit, 0.0];
    let up_specials = [limit, -limit, limit + 0.5, -limit - 0.5, 1e4, -1e4, 0.0];
    let mut x = rng.normals(rows * 2 * inter, 0.0, 6.0);
    for (r, row) in x.chunks_mut(2 * inter).enumerate() {
        for (i, v) in row.iter_mut().enumerate() {
            if (i + r) % 5 == 0 {
                let k = i / 5 + r;
                *v = if i % 2 == 0 {
                    gate_specials[k % gate_specials.len()]
                } else {
                    up_specials[k % up_specials.len()]
                };
            }
        }
    }
    x.into_iter().map(|v| round_to(dtype, v)).collect()
}

#[allow(clippy::too_many_arguments)]
fn check<R: Runtime>(
    client: &ComputeClient<R>,
    device: &R::Device,
    rows: usize,
    inter: usize,
    pad: usize,
    dtype: FloatDtype,
    config: Option<&TileLaunch>,
    rng: &mut Rng,
) {
    let seed = rng.seed();
    let what = format!("rows {rows} inter {inter} pad {pad} {dtype} {config:?} seed {seed}");
    let x = input(rng, dtype, rows, inter);
    let dout: Vec<f64> = rng
        .normals(rows * inter, 0.0, 1.0)
        .into_iter()
        .map(|v| round_to(dtype, v))
        .collect();
    let round = |v| round_to(dtype, v);
    let (alpha, limit) = (ALPHA as f64, LIMIT as f64);
    let out_ref = reference::forward(&x, alpha, limit, round);
    let dx_ref = reference::backward(&x, &dout, alpha, limit, round);

    let (wide, narrow) = (2 * inter + 2 * pad, inter + pad);
    let problem = GegluProblem {
        rows,
        inter,
        alpha: ALPHA,
        limit: LIMIT,
        dtype,
        stride_multiple: gcd(gcd(inter, wide), narrow),
    };
    let matrix = |values: &[f64], width: usize, stride: usize| Rows {
        handle: upload(client, dtype, &pad_rows(values, width, stride)),
        stride,
    };
    let poison = |stride: usize| Rows {
        handle: poisoned(client, dtype, rows * stride),
        stride,
    };
    let fwd = GegluForwardBuffers {
        input: matrix(&x, 2 * inter, wide),
        out: poison(narrow),
    };
    match config {
        Some(c) => geglu::forward_with(client, &problem, &fwd, c).unwrap(),
        None => geglu::forward(client, device, &problem, &fwd).unwrap(),
    }
    let out = unpad_rows(
        download(client, dtype, fwd.out.handle.clone()),
        inter,
        narrow,
        &what,
    );
    assert_close(
        &format!("out {what}"),
        &out,
        &out_ref,
        tolerance(dtype),
        seed,
    );

    let bwd = GegluBackwardBuffers {
        input: fwd.input.clone(),
        dout: matrix(&dout, inter, narrow),
        dinput: poison(wide),
    };
    match config {
        Some(c) => geglu::backward_with(client, &problem, &bwd, c).unwrap(),
        None => geglu::backward(client, device, &problem, &bwd).unwrap(),
    }
    let dx = unpad_rows(
        download(client, dtype, bwd.dinput.handle.clone()),
        2 * inter,
        wide,
        &what,
    );
    assert_close(
        &format!("d_input {what}"),
        &dx,
        &dx_ref,
        tolerance(dtype),
        seed,
    );

    // The clamp rule, element by element: exactly zero where the clamp is
    // active, the unclamped gradient at exactly ±limit.
    for (i, (&v, &g)) in x.iter().zip(&dx).enumerate() {
        let is_gate = i % 2 == 0;
        let clamped = if is_gate { v > limit } else { v.abs() > limit };
        if clamped {
            assert_eq!(
                g, 0.0,
                "{what}: gradient through an active clamp at {i} (x = {v})"
            );
        } else if v.abs() == limit && dx_ref[i] != 0.0 {
            assert!(
                g != 0.0 && g.signum() == dx_ref[i].signum(),
                "{what}: the gradient must pass at the clamp boundary {i} (x = {v}, got {g}, want {})",
                dx_ref[i]
            );
        }
    }
}

struct EveryCandidate;

impl RuntimeTest for EveryCandidate {
    fn run<R: Runtime>(&self, device: &R::Device, runtime: &str, dtypes: &[FloatDtype]) {
        let client = R::client(device);
        let mut rng = Rng::fresh();
        for dtype in supported_dtypes(&client, dtypes) {
            let (rows, inter) = (19, 200);
            let problem = GegluProblem {
                rows,
                inter,
                alpha: ALPHA,
                limit: LIMIT,
                dtype,
                stride_multiple: inter,
            };
            let candidates = geglu::candidates(&client, &problem);
            assert!(candidates.len() >= 3, "{runtime}: {candidates:?}");
            for c in &candidates {
                check(&client, device, rows, inter, 0, dtype, Some(c), &mut rng);
            }
        }
    }
}

#[test]
fn geglu_every_candidate_matches_reference_and_clamp_rule() {
    for_each_runtime(&EveryCandidate);
}

struct ShapeGrid;

impl RuntimeTest for ShapeGrid {
    fn run<R: Runtime>(&self, device: &R::Device, _runtime: &str, dtypes: &[FloatDtype]) {
        let client = R::client(device);
        let mut rng = Rng::fresh();
        for dtype in supported_dtypes(&client, dtypes) {
            for (rows, inter, pad) in [
                (1usize, 1usize, 0usize),
                (3, 37, 1),
                (65, 1000, 0),
                (7, 2880, 8),
                (2, 3072, 0),
            ] {
                check(&client, device, rows, inter, pad, dtype, None, &mut rng);
            }
        }
    }
}

#[test]
fn geglu_autotuned_matches_reference_on_odd_and_model_shapes() {
    for_each_runtime(&ShapeGrid);
}

struct Rejects;

impl RuntimeTest for Rejects {
    fn run<R: Runtime>(&self, device: &R::Device, _runtime: &str, _dtypes: &[FloatDtype]) {
        let client = R::client(device);
        let buffers = GegluForwardBuffers {
            input: Rows::dense(client.empty(64), 8),
            out: Rows::dense(client.empty(64), 4),
        };
        for (inter, limit) in [(0usize, 7.0f32), (4, -1.0), (4, f32::NAN)] {
            let problem = GegluProblem {
                rows: 2,
                inter,
                alpha: ALPHA,
                limit,
                dtype: FloatDtype::F32,
                stride_multiple: 4,
            };
            let err = geglu::forward(&client, device, &problem, &buffers).unwrap_err();
            assert!(matches!(err, KernelError::Shape(_)), "{err}");
        }
    }
}

#[test]
fn geglu_rejects_bad_problems() {
    for_each_runtime(&Rejects);
}
