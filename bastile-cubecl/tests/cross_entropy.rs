//! Cross-entropy kernel against the f64 reference: every candidate, the
//! autotuned entry point over odd and vocabulary-sized rows, every option
//! (ignore index, label smoothing, z-loss, soft cap), the three modes, in
//! place and out of place, per-row and uniform gradient scales, slices of
//! the vocabulary, padded pitches and NaN-poisoned outputs.

use bastile_cubecl::cross_entropy::{
    self, CrossEntropyBuffers, CrossEntropyLaunch, CrossEntropyMode, CrossEntropyProblem, RowScale,
    VocabSlice,
};
use bastile_cubecl::launch::gcd;
use bastile_cubecl::reference::cross_entropy::{self as reference, Options};
use bastile_cubecl::rows::Rows;
use bastile_cubecl::testing::*;
use bastile_cubecl::{FloatDtype, KernelError};
use cubecl::prelude::*;

/// One case: shape, options, what the launch computes and where.
#[derive(Clone, Copy, Debug)]
struct Case {
    rows: usize,
    vocab: usize,
    /// Extra NaN elements at the end of every logits row.
    pad: usize,
    options: Options,
    mode: CrossEntropyMode,
    row_scale: RowScale,
    in_place: bool,
    /// Every n-th label is the ignore index (0: none).
    ignore_every: usize,
    /// Standard deviation of the logits.
    std: f64,
    /// Launch over columns `offset .. offset + width` of each row only
    /// (`(offset, width)`, gradient-only mode).
    slice: Option<(usize, usize)>,
}

impl Case {
    fn new(rows: usize, vocab: usize) -> Self {
        Self {
            rows,
            vocab,
            pad: 0,
            options: Options::default(),
            mode: CrossEntropyMode::StatsAndGrad,
            row_scale: RowScale::None,
            in_place: false,
            ignore_every: 0,
            std: 2.0,
            slice: None,
        }
    }
}

fn upload_f32<R: Runtime>(client: &ComputeClient<R>, values: &[f64]) -> cubecl::server::Handle {
    upload(client, FloatDtype::F32, values)
}

fn upload_labels<R: Runtime>(client: &ComputeClient<R>, labels: &[i64]) -> cubecl::server::Handle {
    let labels: Vec<i32> = labels.iter().map(|&l| l as i32).collect();
    upload_i32(client, &labels)
}

fn check<R: Runtime>(
    client: &ComputeClient<R>,
    device: &R::Device,
    dtype: FloatDtype,
    case: Case,
    config: Option<&CrossEntropyLaunch>,
    rng: &mut Rng,
) {
    let seed = rng.seed();
    let what = format!("{dtype} {case:?} {config:?} seed {seed}");
    let Case { rows, vocab, .. } = case;
    let logits: Vec<f64> = rng
        .normals(rows * vocab, 0.0, case.std)
        .into_iter()
        .map(|v| round_to(dtype, v))
        .collect();
    let labels: Vec<i64> = (0..rows)
        .map(|r| {
            if case.ignore_every > 0 && r % case.ignore_every == 0 {
                case.options.ignore_index
            } else {
                (rng.next_u64() % vocab as u64) as i64
            }
        })
        .collect();
    let expected = reference::rows(&logits, vocab, &labels, &case.options);
    let ignored: Vec<bool> = labels
        .iter()
        .map(|&l| l == case.options.ignore_index)
        .collect();
    let scale = 0.75;
    let row_scales: Vec<f64> = match case.row_scale {
        RowScale::None => vec![],
        RowScale::Uniform => vec![1.5],
        RowScale::PerRow => rng.normals(rows, 0.0, 1.0),
    };
    let row_factor = |r: usize| match case.row_scale {
        RowScale::None => 1.0,
        RowScale::Uniform => row_scales[0],
        RowScale::PerRow => row_scales[r],
    };

    // The columns the launch reads: every one, or the case's slice.
    let (first, width) = case.slice.unwrap_or((0, vocab));
    let columns = |values: &[f64]| -> Vec<f64> {
        values
            .chunks(vocab)
            .flat_map(|row| row[first..first + width].to_vec())
            .collect()
    };
    let launched = columns(&logits);
    let stride = width + case.pad;
    let logits_rows = Rows {
        handle: upload(client, dtype, &pad_rows(&launched, width, stride)),
        stride,
    };
    let grad = (!case.in_place).then(|| Rows {
        handle: poisoned(client, dtype, rows * stride),
        stride,
    });
    let lse_in: Vec<f64> = expected.iter().map(|r| r.lse).collect();
    let buffers = CrossEntropyBuffers {
        logits: logits_rows.clone(),
        labels: upload_labels(client, &labels),
        grad: grad.clone(),
        losses: poisoned(client, FloatDtype::F32, rows),
        lse: if case.mode == CrossEntropyMode::Grad {
            upload_f32(client, &lse_in)
        } else {
            poisoned(client, FloatDtype::F32, rows)
        },
        row_scale: (!row_scales.is_empty()).then(|| upload_f32(client, &row_scales)),
    };
    let problem = CrossEntropyProblem {
        rows,
        vocab: width,
        slice: case.slice.map(|(offset, _)| VocabSlice { offset, vocab }),
        dtype,
        stride_multiple: gcd(width, stride),
        ignore_index: case.options.ignore_index as i32,
        label_smoothing: case.options.label_smoothing as f32,
        z_loss: case.options.z_loss as f32,
        softcap: case.options.softcap.map(|c| c as f32),
        scale: scale as f32,
        mode: case.mode,
        row_scale: case.row_scale,
    };
    match config {
        Some(c) => cross_entropy::launch_with(client, &problem, &buffers, c).unwrap(),
        None => cross_entropy::run(client, device, &problem, &buffers).unwrap(),
    }

    let losses = download(client, FloatDtype::F32, buffers.losses.clone());
    let lse = download(client, FloatDtype::F32, buffers.lse.clone());
    if case.mode == CrossEntropyMode::Grad {
        assert!(
            losses.iter().all(|v| v.is_nan()),
            "{what}: the gradient-only mode wrote losses"
        );
    } else {
        let loss_ref: Vec<f64> = expected.iter().map(|r| r.loss).collect();
        assert_close(&format!("losses {what}"), &losses, &loss_ref, 2e-5, seed);
        assert_close(&format!("lse {what}"), &lse, &lse_in, 2e-5, seed);
        for r in (0..rows).filter(|&r| ignored[r]) {
            assert_eq!(losses[r], 0.0, "{what}: ignored row {r} has a loss");
        }
    }

    let grad_handle = match &grad {
        Some(g) => g.handle.clone(),
        None => logits_rows.handle.clone(),
    };
    let got = unpad_rows(download(client, dtype, grad_handle), width, stride, &what);
    if case.mode == CrossEntropyMode::Stats {
        if case.in_place {
            assert_eq!(got, launched, "{what}: the stats mode changed the logits");
        } else {
            assert!(
                got.iter().all(|v| v.is_nan()),
                "{what}: the stats mode wrote a gradient"
            );
        }
        return;
    }
    let grad_ref: Vec<f64> = columns(
        &expected
            .iter()
            .enumerate()
            .flat_map(|(r, row)| {
                let s = scale * row_factor(r);
                row.grad.iter().map(move |g| g * s)
            })
            .collect::<Vec<_>>(),
    );
    for r in (0..rows).filter(|&r| ignored[r]) {
        assert!(
            got[r * width..(r + 1) * width].iter().all(|g| *g == 0.0),
            "{what}: ignored row {r} has a nonzero gradient"
        );
    }
    if grad_ref.iter().any(|g| *g != 0.0) {
        assert_close_to_magnitude(&format!("grad {what}"), &got, &grad_ref, tolerance(dtype));
    }
}

fn with_options(case: Case, options: Options) -> Case {
    Case { options, ..case }
}

/// Every candidate on one odd shape, with every option on.
struct EveryCandidate;

impl RuntimeTest for EveryCandidate {
    fn run<R: Runtime>(&self, device: &R::Device, runtime: &str, dtypes: &[FloatDtype]) {
        let client = R::client(device);
        let mut rng = Rng::fresh();
        for dtype in supported_dtypes(&client, dtypes) {
            let base = Case {
                pad: 8,
                ignore_every: 4,
                ..Case::new(9, 1000)
            };
            let problem = CrossEntropyProblem {
                rows: base.rows,
                vocab: base.vocab,
                slice: None,
                dtype,
                stride_multiple: gcd(base.vocab, base.vocab + base.pad),
                ignore_index: -100,
                label_smoothing: 0.0,
                z_loss: 0.0,
                softcap: None,
                scale: 1.0,
                mode: CrossEntropyMode::StatsAndGrad,
                row_scale: RowScale::None,
            };
            let candidates = cross_entropy::candidates(&client, &problem);
            assert!(candidates.len() >= 3, "{runtime}: {candidates:?}");
            let all = Options {
                ignore_index: -100,
                label_smoothing: 0.1,
                z_loss: 1e-2,
                softcap: Some(4.0),
            };
            for c in &candidates {
                check(&client, device, dtype, base, Some(c), &mut rng);
                check(
                    &client,
                    device,
                    dtype,
                    Case {
                        in_place: true,
                        ..with_options(base, all)
                    },
                    Some(c),
                    &mut rng,
                );
            }
        }
    }
}

#[test]
fn cross_entropy_every_candidate_matches_reference() {
    for_each_runtime(&EveryCandidate);
}

/// The autotuned kernel on odd and vocabulary-sized rows, each option alone
/// and all together, every mode and scale source.
struct OptionsAndModes;

impl RuntimeTest for OptionsAndModes {
    fn run<R: Runtime>(&self, device: &R::Device, _runtime: &str, dtypes: &[FloatDtype]) {
        let client = R::client(device);
        let mut rng = Rng::fresh();
        let plain = Options::default();
        let options = [
            plain,
            Options {
                label_smoothing: 0.2,
                ..plain
            },
            Options {
                z_loss: 1e-2,
                ..plain
            },
            Options {
                softcap: Some(3.0),
                ..plain
            },
            // A class id as the ignore index (pad-token style).
            Options {
                ignore_index: 2,
                label_smoothing: 0.05,
                z_loss: 1e-3,
                softcap: Some(30.0),
            },
        ];
        for dtype in supported_dtypes(&client, dtypes) {
            for (i, (rows, vocab, pad)) in [
                (1usize, 1usize, 0usize),
                (3, 7, 1),
                (5, 64, 0),
                (17, 1003, 5),
                (4, 50257, 0),
                (2, 151936, 8),
            ]
            .into_iter()
            .enumerate()
            {
                let opts = options[i % options.len()];
                let case = Case {
                    pad,
                    ignore_every: 3,
                    std: if opts.softcap.is_some() { 8.0 } else { 2.0 },
                    ..with_options(Case::new(rows, vocab), opts)
                };
                check(&client, device, dtype, case, None, &mut rng);
                for (mode, row_scale, in_place) in [
                    (CrossEntropyMode::Stats, RowScale::None, false),
                    (CrossEntropyMode::Stats, RowScale::None, true),
                    (CrossEntropyMode::StatsAndGrad, RowScale::Uniform, true),
                    (CrossEntropyMode::Grad, RowScale::PerRow, false),
                    (CrossEntropyMode::Grad, RowScale::Uniform, true),
                ] {
                    let case = Case {
                        mode,
                        row_scale,
                        in_place,
                        ..case
                    };
                    check(&client, device, dtype, case, None, &mut rng);
                }
            }
            // Every option at once on a wider row, and every row ignored.
            let all = Options {
                ignore_index: -100,
                label_smoothing: 0.1,
                z_loss: 1e-3,
                softcap: Some(15.0),
            };
            let case = Case {
                std: 10.0,
                ignore_every: 5,
                ..with_options(Case::new(33, 4096), all)
            };
            check(&client, device, dtype, case, None, &mut rng);
            let ignored = Case {
                ignore_every: 1,
                ..Case::new(6, 300)
            };
            check(&client, device, dtype, ignored, None, &mut rng);
            // Slices of the vocabulary (first, middle and an odd last one,
            // in place and out), each row's label in or out of the slice,
            // against the columns of the whole rows' gradient.
            let sliced = Case {
                mode: CrossEntropyMode::Grad,
                row_scale: RowScale::PerRow,
                ignore_every: 4,
                std: 8.0,
                ..with_options(Case::new(19, 1003), all)
            };
            for (slice, in_place, pad) in [
                ((0, 496), false, 0),
                ((496, 8), true, 0),
                ((504, 499), false, 3),
            ] {
                let case = Case {
                    slice: Some(slice),
                    in_place,
                    pad,
                    ..sliced
                };
                check(&client, device, dtype, case, None, &mut rng);
            }
        }
    }
}

#[test]
fn cross_entropy_options_and_modes_match_reference() {
    for_each_runtime(&OptionsAndModes);
}

/// Invalid problems are errors, not launches.
struct Rejects;

impl RuntimeTest for Rejects {
    fn run<R: Runtime>(&self, device: &R::Device, _runtime: &str, _dtypes: &[FloatDtype]) {
        let client = R::client(device);
        let buffers = CrossEntropyBuffers {
            logits: Rows::dense(client.empty(64), 4),
            labels: client.empty(16),
            grad: None,
            losses: client.empty(16),
            lse: client.empty(16),
            row_scale: None,
        };
        let good = CrossEntropyProblem {
            rows: 2,
            vocab: 4,
            slice: None,
            dtype: FloatDtype::F32,
            stride_multiple: 4,
            ignore_index: -100,
            label_smoothing: 0.0,
            z_loss: 0.0,
            softcap: None,
            scale: 1.0,
            mode: CrossEntropyMode::Stats,
            row_scale: RowScale::None,
        };
        for bad in [
            CrossEntropyProblem { vocab: 0, ..good },
            CrossEntropyProblem {
                label_smoothing: 1.5,
                ..good
            },
            CrossEntropyProblem {
                softcap: Some(0.0),
                ..good
            },
            CrossEntropyProblem {
                z_loss: f32::NAN,
                ..good
            },
            CrossEntropyProblem {
                row_scale: RowScale::PerRow,
                mode: CrossEntropyMode::Grad,
                ..good
            },
            // Statistics need whole rows; a slice must lie in its rows.
            CrossEntropyProblem {
                slice: Some(VocabSlice {
                    offset: 0,
                    vocab: 8,
                }),
                ..good
            },
            CrossEntropyProblem {
                slice: Some(VocabSlice {
                    offset: 5,
                    vocab: 8,
                }),
                mode: CrossEntropyMode::Grad,
                ..good
            },
        ] {
            let err = cross_entropy::run(&client, device, &bad, &buffers).unwrap_err();
            assert!(matches!(err, KernelError::Shape(_)), "{bad:?}: {err}");
        }
    }
}

#[test]
fn cross_entropy_rejects_invalid_problems() {
    for_each_runtime(&Rejects);
}
