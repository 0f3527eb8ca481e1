//! RMSNorm kernels against the f64 reference: every launch configuration
//! the autotuner may pick, and the autotuned entry points, on fresh random
//! inputs, odd shapes, both cast conventions, NaN-poisoned outputs.

use bastile_cubecl::reference::rms_norm as reference;
use bastile_cubecl::rms_norm::{
    self, BackwardBuffers, ForwardBuffers, RmsNormCast, RmsNormLaunch, RmsNormProblem, Rows,
};
use bastile_cubecl::testing::*;
use bastile_cubecl::{FloatDtype, KernelError};
use cubecl::prelude::*;

struct Inputs {
    x: Vec<f64>,
    gamma: Vec<f64>,
    dy: Vec<f64>,
}

fn inputs(rng: &mut Rng, dtype: FloatDtype, rows: usize, hidden: usize) -> Inputs {
    // Values rounded to the dtype first: the reference sees what the kernel sees.
    let round = |v: Vec<f64>| {
        v.into_iter()
            .map(|x| round_to(dtype, x))
            .collect::<Vec<_>>()
    };
    Inputs {
        x: round(rng.normals(rows * hidden, 0.3, 1.5)),
        gamma: round(rng.normals(hidden, 1.0, 0.5)),
        dy: round(rng.normals(rows * hidden, 0.0, 1.0)),
    }
}

/// Runs forward and backward with `config` (or autotuned when `None`) and
/// checks y, rstd, dx and dγ against the reference. The row matrices are
/// laid out with rows `problem.stride_multiple` elements apart.
fn check<R: Runtime>(
    client: &ComputeClient<R>,
    device: &R::Device,
    problem: &RmsNormProblem,
    config: Option<&RmsNormLaunch>,
    rng: &mut Rng,
) {
    let (rows, hidden, dtype) = (problem.rows, problem.hidden, problem.dtype);
    let stride = problem.stride_multiple;
    let rows_of = |values: &[f64]| Rows {
        handle: upload(client, dtype, &pad_rows(values, hidden, stride)),
        stride,
    };
    let poisoned_rows = || Rows {
        handle: poisoned(client, dtype, rows * stride),
        stride,
    };
    let seed = rng.seed();
    let data = inputs(rng, dtype, rows, hidden);
    let round = |v| round_to(dtype, v);
    let eps = problem.eps as f64;
    let (y_ref, rstd_ref) =
        reference::forward(&data.x, &data.gamma, hidden, eps, problem.cast, round);
    let (dx_ref, dg_ref) = reference::backward(
        &data.x,
        &data.gamma,
        &data.dy,
        hidden,
        eps,
        problem.cast,
        round,
    );

    let fwd = ForwardBuffers {
        x: rows_of(&data.x),
        gamma: upload(client, dtype, &data.gamma),
        out: poisoned_rows(),
        rstd: poisoned(client, FloatDtype::F32, rows),
    };
    match config {
        Some(c) => rms_norm::forward_with(client, problem, &fwd, c).unwrap(),
        None => rms_norm::forward(client, device, problem, &fwd).unwrap(),
    }
    let what = format!("{problem:?} {config:?}");
    let tol = tolerance(dtype);
    let y = unpad_rows(
        download(client, dtype, fwd.out.handle.clone()),
        hidden,
        stride,
        &what,
    );
    assert_close(&format!("y {what}"), &y, &y_ref, tol, seed);
    assert_close(
        &format!("rstd {what}"),
        &download(client, FloatDtype::F32, fwd.rstd.clone()),
        &rstd_ref,
        tolerance(FloatDtype::F32),
        seed,
    );

    let bwd = BackwardBuffers {
        x: fwd.x.clone(),
        gamma: fwd.gamma.clone(),
        rstd: fwd.rstd.clone(),
        dy: rows_of(&data.dy),
        dx: poisoned_rows(),
        dgamma: poisoned(client, dtype, hidden),
    };
    match config {
        Some(c) => rms_norm::backward_with(client, problem, &bwd, c).unwrap(),
        None => rms_norm::backward(client, device, problem, &bwd).unwrap(),
    }
    let dx = unpad_rows(
        download(client, dtype, bwd.dx.handle),
        hidden,
        stride,
        &what,
    );
    assert_close(&format!("dx {what}"), &dx, &dx_ref, tol, seed);
    // dγ sums `rows` products in f32: allow for the accumulation length.
    let dg_tol = tol.max(1e-6 * (rows as f64).sqrt());
    assert_close(
        &format!("dgamma {what}"),
        &download(client, dtype, bwd.dgamma),
        &dg_ref,
        dg_tol,
        seed,
    );
}

/// Every candidate configuration on a few shapes that exercise partial
/// vectors per unit, several rows per cube and rows not divisible by it.
struct EveryCandidate;

impl RuntimeTest for EveryCandidate {
    fn run<R: Runtime>(&self, device: &R::Device, runtime: &str, dtypes: &[FloatDtype]) {
        let client = R::client(device);
        let mut rng = Rng::fresh();
        for (d, dtype) in supported_dtypes(&client, dtypes).into_iter().enumerate() {
            // Dense rows, and rows padded to a wider pitch (as CubeCL's
            // optimized layouts allocate them), one of them an odd pitch.
            for (shape, (rows, hidden, stride, cast)) in [
                (37, 1000, 1000, RmsNormCast::Llama),
                (37, 1000, 1024, RmsNormCast::GptOss),
                (3, 896, 896, RmsNormCast::GptOss),
                (130, 64, 64, RmsNormCast::Llama),
                (11, 96, 128, RmsNormCast::Llama),
                (5, 96, 101, RmsNormCast::GptOss),
            ]
            .into_iter()
            .enumerate()
            {
                let problem = RmsNormProblem {
                    rows,
                    hidden,
                    eps: 1e-6,
                    cast,
                    dtype,
                    stride_multiple: stride,
                };
                let candidates = rms_norm::candidates(&client, &problem);
                assert!(
                    !candidates.is_empty(),
                    "{runtime}: no candidate for {problem:?}"
                );
                // Off CUDA the shapes take turns: each candidate runs on
                // two shapes per dtype.
                for c in share(&candidates, shape + d, 3, thorough(runtime)) {
                    check(&client, device, &problem, Some(c), &mut rng);
                }
            }
        }
    }
}

#[test]
fn rms_norm_every_candidate_matches_reference() {
    for_each_runtime(&EveryCandidate);
}

/// The autotuned entry points over the shape grid of the spec.
struct ShapeGrid;

impl RuntimeTest for ShapeGrid {
    fn run<R: Runtime>(&self, device: &R::Device, runtime: &str, dtypes: &[FloatDtype]) {
        let client = R::client(device);
        let mut rng = Rng::fresh();
        for dtype in supported_dtypes(&client, dtypes) {
            for rows in [1usize, 3, 1000, 4097] {
                for hidden in [64usize, 896, 1000, 4096, 5120] {
                    for cast in [RmsNormCast::Llama, RmsNormCast::GptOss] {
                        // The largest shapes once per dtype, and off CUDA
                        // not at all: 4097 rows and the 4096/5120 widths
                        // are each checked on smaller partners.
                        let large = rows * hidden > 4_000_000;
                        if large && (cast == RmsNormCast::GptOss || !thorough(runtime)) {
                            continue;
                        }
                        let problem = RmsNormProblem {
                            rows,
                            hidden,
                            eps: 1e-5,
                            cast,
                            dtype,
                            stride_multiple: hidden,
                        };
                        check(&client, device, &problem, None, &mut rng);
                    }
                }
            }
        }
    }
}

#[test]
fn rms_norm_autotuned_matches_reference_on_odd_shapes() {
    for_each_runtime(&ShapeGrid);
}

/// Odd hidden sizes fall back to narrower vectors and still match.
struct OddHidden;

impl RuntimeTest for OddHidden {
    fn run<R: Runtime>(&self, device: &R::Device, _runtime: &str, dtypes: &[FloatDtype]) {
        let client = R::client(device);
        let mut rng = Rng::fresh();
        for dtype in supported_dtypes(&client, dtypes) {
            for hidden in [3usize, 7, 130, 1023] {
                let problem = RmsNormProblem {
                    rows: 5,
                    hidden,
                    eps: 1e-6,
                    cast: RmsNormCast::Llama,
                    dtype,
                    stride_multiple: hidden,
                };
                check(&client, device, &problem, None, &mut rng);
            }
        }
    }
}

#[test]
fn rms_norm_odd_hidden_sizes() {
    for_each_runtime(&OddHidden);
}

/// Invalid problems and configurations are reported, not launched.
struct Rejects;

impl RuntimeTest for Rejects {
    fn run<R: Runtime>(&self, device: &R::Device, _runtime: &str, _dtypes: &[FloatDtype]) {
        let client = R::client(device);
        let bufs = ForwardBuffers {
            x: Rows::dense(client.empty(64), 4),
            gamma: client.empty(64),
            out: Rows::dense(client.empty(64), 4),
            rstd: client.empty(64),
        };
        let empty = RmsNormProblem {
            rows: 4,
            hidden: 0,
            eps: 1e-6,
            cast: RmsNormCast::Llama,
            dtype: FloatDtype::F32,
            stride_multiple: 4,
        };
        assert!(matches!(
            rms_norm::forward(&client, device, &empty, &bufs),
            Err(KernelError::Shape(_))
        ));
        let bad_eps = RmsNormProblem {
            hidden: 4,
            eps: f32::NAN,
            ..empty
        };
        assert!(matches!(
            rms_norm::forward(&client, device, &bad_eps, &bufs),
            Err(KernelError::Shape(_))
        ));
        let problem = RmsNormProblem {
            hidden: 6,
            stride_multiple: 6,
            eps: 1e-6,
            ..empty
        };
        let wrong_vector = RmsNormLaunch {
            vector_size: 4,
            units_per_row: 32,
            rows_per_cube: 1,
            reduce: bastile_cubecl::reduce::RowReduce::Shared,
        };
        assert!(matches!(
            rms_norm::forward_with(&client, &problem, &bufs, &wrong_vector),
            Err(KernelError::Unsupported(_))
        ));
    }
}

#[test]
fn rms_norm_rejects_invalid_problems() {
    for_each_runtime(&Rejects);
}
