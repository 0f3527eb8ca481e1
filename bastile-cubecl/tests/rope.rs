//! RoPE kernel against the f64 reference: both pairings, forward and
//! inverse, GQA (q and k with different head counts in one launch),
//! `[b, h, s, d]` and `[b, s, h, d]` storage with padded strides, start
//! offsets, per-batch tables (explicit position ids), odd head_dim and
//! sequence lengths, NaN-poisoned outputs.

use bastile_cubecl::elementwise::TileLaunch;
use bastile_cubecl::launch::gcd;
use bastile_cubecl::reference::rope as reference;
use bastile_cubecl::rope::{self, HeadStrides, HeadTensor, RopeBuffers, RopePairing, RopeProblem};
use bastile_cubecl::testing::*;
use bastile_cubecl::{FloatDtype, KernelError};
use cubecl::prelude::*;

#[derive(Clone, Copy, Debug)]
struct Case {
    batch: usize,
    q_heads: usize,
    k_heads: usize,
    seq: usize,
    head_dim: usize,
    /// `[b, s, h, d]` storage instead of `[b, h, s, d]`.
    bshd: bool,
    /// Extra elements after each innermost row (padding, NaN).
    pad: usize,
    pairing: RopePairing,
    inverse: bool,
    offset: usize,
    table_batched: bool,
}

impl Case {
    fn strides(&self, heads: usize) -> HeadStrides {
        let row = self.head_dim + self.pad;
        if self.bshd {
            HeadStrides {
                batch: self.seq * heads * row,
                head: row,
                seq: heads * row,
            }
        } else {
            HeadStrides {
                batch: heads * self.seq * row,
                head: self.seq * row,
                seq: row,
            }
        }
    }

    fn len(&self, heads: usize) -> usize {
        self.batch * heads * self.seq * (self.head_dim + self.pad)
    }

    fn at(&self, s: &HeadStrides, b: usize, h: usize, p: usize) -> usize {
        b * s.batch + h * s.head + p * s.seq
    }
}

/// Lays logical `[b, h, s, d]` values into a buffer with `strides`, NaN elsewhere.
fn scatter(case: &Case, heads: usize, values: &[f64]) -> Vec<f64> {
    let strides = case.strides(heads);
    let d = case.head_dim;
    let mut out = vec![f64::NAN; case.len(heads)];
    let mut i = 0;
    for b in 0..case.batch {
        for h in 0..heads {
            for p in 0..case.seq {
                let at = case.at(&strides, b, h, p);
                out[at..at + d].copy_from_slice(&values[i..i + d]);
                i += d;
            }
        }
    }
    out
}

/// Reads logical `[b, h, s, d]` values back, asserting nothing else was written.
fn gather(case: &Case, heads: usize, buffer: &[f64], what: &str) -> Vec<f64> {
    let strides = case.strides(heads);
    let d = case.head_dim;
    let mut touched = vec![false; buffer.len()];
    let mut out = Vec::new();
    for b in 0..case.batch {
        for h in 0..heads {
            for p in 0..case.seq {
                let at = case.at(&strides, b, h, p);
                out.extend_from_slice(&buffer[at..at + d]);
                touched[at..at + d].iter_mut().for_each(|t| *t = true);
            }
        }
    }
    for (i, v) in buffer.iter().enumerate() {
        assert!(
            touched[i] || v.is_nan(),
            "{what}: the kernel wrote outside the tensor at {i}"
        );
    }
    out
}

fn check<R: Runtime>(
    client: &ComputeClient<R>,
    device: &R::Device,
    case: Case,
    dtype: FloatDtype,
    config: Option<&TileLaunch>,
    rng: &mut Rng,
) {
    let seed = rng.seed();
    let what = format!("{case:?} {dtype} {config:?} seed {seed}");
    let (d, half) = (case.head_dim, case.head_dim / 2);
    let table_rows = case.offset + case.seq + 3;
    let tables = if case.table_batched { case.batch } else { 1 };
    let angles: Vec<f64> = (0..tables * table_rows * half)
        .map(|_| rng.uniform() * 200.0 - 100.0)
        .collect();
    let f32_of = |v: f64| round_to(FloatDtype::F32, v);
    let cos: Vec<f64> = angles.iter().map(|a| f32_of(a.cos())).collect();
    let sin: Vec<f64> = angles.iter().map(|a| f32_of(a.sin())).collect();
    let mut values = |heads: usize| -> Vec<f64> {
        rng.normals(case.batch * heads * case.seq * d, 0.0, 1.0)
            .into_iter()
            .map(|v| round_to(dtype, v))
            .collect()
    };
    let q = values(case.q_heads);
    let k = values(case.k_heads);

    let round = |v| round_to(dtype, v);
    let expected = |x: &[f64]| -> Vec<f64> {
        let mut out = Vec::with_capacity(x.len());
        for (row, head) in x.chunks(d).enumerate() {
            let p = row % case.seq;
            let b = row / case.seq / (x.len() / d / case.seq / case.batch);
            let t = if case.table_batched {
                b * table_rows
            } else {
                0
            } + case.offset
                + p;
            out.extend(reference::rotate(
                head,
                &cos[t * half..(t + 1) * half],
                &sin[t * half..(t + 1) * half],
                case.pairing,
                case.inverse,
                round,
            ));
        }
        out
    };

    let head = |heads: usize, values: Option<&[f64]>| HeadTensor {
        handle: match values {
            Some(v) => upload(client, dtype, &scatter(&case, heads, v)),
            None => poisoned(client, dtype, case.len(heads)),
        },
        strides: case.strides(heads),
    };
    let buffers = RopeBuffers {
        q: head(case.q_heads, Some(&q)),
        k: head(case.k_heads, Some(&k)),
        q_out: head(case.q_heads, None),
        k_out: head(case.k_heads, None),
        cos: upload(client, FloatDtype::F32, &cos),
        sin: upload(client, FloatDtype::F32, &sin),
    };
    let strides = [case.strides(case.q_heads), case.strides(case.k_heads)];
    let problem = RopeProblem {
        batch: case.batch,
        seq: case.seq,
        q_heads: case.q_heads,
        k_heads: case.k_heads,
        head_dim: d,
        dtype,
        pairing: case.pairing,
        inverse: case.inverse,
        offset: case.offset,
        table_rows,
        table_batched: case.table_batched,
        stride_multiple: strides
            .iter()
            .flat_map(|s| [s.batch, s.head, s.seq])
            .fold(d, gcd),
    };
    match config {
        Some(c) => rope::rope_with(client, &problem, &buffers, c).unwrap(),
        None => rope::rope(client, device, &problem, &buffers).unwrap(),
    }
    let tol = tolerance(dtype);
    for (name, heads, out, input) in [
        ("q", case.q_heads, &buffers.q_out, &q),
        ("k", case.k_heads, &buffers.k_out, &k),
    ] {
        let got = gather(
            &case,
            heads,
            &download(client, dtype, out.handle.clone()),
            &what,
        );
        assert_close(&format!("{name} {what}"), &got, &expected(input), tol, seed);
    }
}

const BASE: Case = Case {
    batch: 2,
    q_heads: 4,
    k_heads: 2,
    seq: 7,
    head_dim: 64,
    bshd: false,
    pad: 0,
    pairing: RopePairing::Half,
    inverse: false,
    offset: 0,
    table_batched: false,
};

struct EveryCandidate;

impl RuntimeTest for EveryCandidate {
    fn run<R: Runtime>(&self, device: &R::Device, runtime: &str, dtypes: &[FloatDtype]) {
        let client = R::client(device);
        let mut rng = Rng::fresh();
        for dtype in supported_dtypes(&client, dtypes) {
            for pairing in [RopePairing::Half, RopePairing::Interleaved] {
                let case = Case { pairing, ..BASE };
                let problem = RopeProblem {
                    batch: case.batch,
                    seq: case.seq,
                    q_heads: case.q_heads,
                    k_heads: case.k_heads,
                    head_dim: case.head_dim,
                    dtype,
                    pairing,
                    inverse: false,
                    offset: 0,
                    table_rows: case.seq,
                    table_batched: false,
                    stride_multiple: case.head_dim,
                };
                let candidates = rope::candidates(&client, &problem);
                assert!(candidates.len() >= 3, "{runtime}: {candidates:?}");
                for c in &candidates {
                    check(&client, device, case, dtype, Some(c), &mut rng);
                }
            }
        }
    }
}

#[test]
fn rope_every_candidate_matches_reference() {
    for_each_runtime(&EveryCandidate);
}

struct Variants;

impl RuntimeTest for Variants {
    fn run<R: Runtime>(&self, device: &R::Device, _runtime: &str, dtypes: &[FloatDtype]) {
        let client = R::client(device);
        let mut rng = Rng::fresh();
        let cases = [
            BASE,
            Case {
                inverse: true,
                ..BASE
            },
            // Qwen3-like GQA 16:8, odd sequence, head_dim 128, [b, s, h, d].
            Case {
                batch: 1,
                q_heads: 16,
                k_heads: 8,
                seq: 129,
                head_dim: 128,
                bshd: true,
                ..BASE
            },
            // head_dim 80, MQA, start offset, padded rows.
            Case {
                batch: 3,
                q_heads: 8,
                k_heads: 1,
                seq: 5,
                head_dim: 80,
                pad: 16,
                offset: 11,
                ..BASE
            },
            // Per-batch tables (explicit position ids), interleaved, inverse, bshd with odd padding.
            Case {
                batch: 2,
                q_heads: 2,
                k_heads: 2,
                seq: 1,
                head_dim: 64,
                bshd: true,
                pad: 3,
                pairing: RopePairing::Interleaved,
                inverse: true,
                table_batched: true,
                ..BASE
            },
            // A head_dim whose half is odd: scalar vectors.
            Case {
                head_dim: 6,
                seq: 33,
                table_batched: true,
                offset: 2,
                ..BASE
            },
            Case {
                head_dim: 6,
                pairing: RopePairing::Interleaved,
                ..BASE
            },
        ];
        for dtype in supported_dtypes(&client, dtypes) {
            for case in cases {
                check(&client, device, case, dtype, None, &mut rng);
            }
        }
    }
}

#[test]
fn rope_autotuned_matches_reference_on_every_variant() {
    for_each_runtime(&Variants);
}

struct Rejects;

impl RuntimeTest for Rejects {
    fn run<R: Runtime>(&self, device: &R::Device, _runtime: &str, _dtypes: &[FloatDtype]) {
        let client = R::client(device);
        let t = || HeadTensor {
            handle: client.empty(1024),
            strides: HeadStrides::bhsd(1, 2, 8),
        };
        let buffers = RopeBuffers {
            q: t(),
            k: t(),
            q_out: t(),
            k_out: t(),
            cos: client.empty(64),
            sin: client.empty(64),
        };
        let good = RopeProblem {
            batch: 1,
            seq: 2,
            q_heads: 1,
            k_heads: 1,
            head_dim: 8,
            dtype: FloatDtype::F32,
            pairing: RopePairing::Half,
            inverse: false,
            offset: 0,
            table_rows: 2,
            table_batched: false,
            stride_multiple: 8,
        };
        for bad in [
            RopeProblem {
                head_dim: 7,
                ..good
            },
            RopeProblem { offset: 1, ..good },
        ] {
            let err = rope::rope(&client, device, &bad, &buffers).unwrap_err();
            assert!(matches!(err, KernelError::Shape(_)), "{err}");
        }
    }
}

#[test]
fn rope_rejects_odd_head_dim_and_short_tables() {
    for_each_runtime(&Rejects);
}
