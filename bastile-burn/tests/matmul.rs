//! Matmul and `linear` through `Bastile<B>`: on CUDA they run on cuBLASLt
//! (the test fails if cuBLASLt cannot be loaded there), elsewhere they are
//! the inner backend's. Checked against an f64 reference and against the
//! inner backend, forward and under `Autodiff`, for square, skinny,
//! batched, broadcast, transposed and size-1 operands, K not a multiple of
//! 8, f32/f16/bf16.

use crate::common::*;
use bastile::ops::KernelBackend;
use bastile::{Bastile, BastileBackend};
use bastile_cubecl::testing::{Rng, assert_close, tolerance};
use burn::backend::Autodiff;
use burn::tensor::{DType, Tensor};

/// `a [batch_a, m, k] · b [batch_b, k, n]` in f64, batch broadcast when one
/// side has 1; `ta`/`tb` say the operand is stored transposed (`[k, m]`).
#[allow(clippy::too_many_arguments)]
fn mm(
    a: &[f64],
    b: &[f64],
    (batch_a, batch_b): (usize, usize),
    m: usize,
    k: usize,
    n: usize,
    ta: bool,
    tb: bool,
) -> Vec<f64> {
    let batch = batch_a.max(batch_b);
    let mut out = vec![0.0; batch * m * n];
    for bi in 0..batch {
        let (ab, bb) = (
            if batch_a == 1 { 0 } else { bi },
            if batch_b == 1 { 0 } else { bi },
        );
        for i in 0..m {
            for j in 0..n {
                out[(bi * m + i) * n + j] = (0..k)
                    .map(|p| {
                        let av = if ta {
                            a[ab * m * k + p * m + i]
                        } else {
                            a[ab * m * k + i * k + p]
                        };
                        let bv = if tb {
                            b[bb * k * n + j * k + p]
                        } else {
                            b[bb * k * n + p * n + j]
                        };
                        av * bv
                    })
                    .sum();
            }
        }
    }
    out
}

/// One problem: `[batch_a, m, k] · [batch_b, k, n]`, each operand possibly
/// given as a transposed view.
#[derive(Clone, Copy, Debug)]
struct Case {
    batch: (usize, usize),
    mkn: [usize; 3],
    transposed: (bool, bool),
}

const CASES: [Case; 9] = [
    Case {
        batch: (1, 1),
        mkn: [64, 64, 64],
        transposed: (false, false),
    },
    Case {
        batch: (1, 1),
        mkn: [1, 300, 5],
        transposed: (false, false),
    },
    Case {
        batch: (1, 1),
        mkn: [129, 1, 77],
        transposed: (false, false),
    },
    Case {
        batch: (1, 1),
        mkn: [37, 13, 50],
        transposed: (false, false),
    },
    Case {
        batch: (1, 1),
        mkn: [1, 1, 1],
        transposed: (false, false),
    },
    Case {
        batch: (1, 1),
        mkn: [33, 27, 19],
        transposed: (true, true),
    },
    Case {
        batch: (6, 6),
        mkn: [17, 33, 9],
        transposed: (false, true),
    },
    Case {
        batch: (5, 1),
        mkn: [20, 24, 31],
        transposed: (true, false),
    },
    Case {
        batch: (1, 4),
        mkn: [7, 40, 8],
        transposed: (false, false),
    },
];

/// The operand `[batch, rows, cols]` holding `values` (row-major), built as
/// a transposed view of a `[batch, cols, rows]` tensor when `transposed`
/// (then `values` is that stored layout).
fn operand<X: burn::tensor::backend::Backend>(
    values: &[f64],
    [batch, rows, cols]: [usize; 3],
    transposed: bool,
    dtype: DType,
    device: &X::Device,
) -> Tensor<X, 3> {
    if transposed {
        tensor::<X, 3>(values, [batch, cols, rows], dtype, device).swap_dims(1, 2)
    } else {
        tensor::<X, 3>(values, [batch, rows, cols], dtype, device)
    }
}

/// `(out, dlhs, drhs)` under `Autodiff<X>` for the output gradient `dout`.
fn run<X: BastileBackend>(
    case: Case,
    (a, b, dout): (&[f64], &[f64], &[f64]),
    dtype: DType,
    device: &X::Device,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let [m, k, n] = case.mkn;
    let (ba, bb) = case.batch;
    let lhs =
        operand::<Autodiff<X>>(a, [ba, m, k], case.transposed.0, dtype, device).require_grad();
    let rhs =
        operand::<Autodiff<X>>(b, [bb, k, n], case.transposed.1, dtype, device).require_grad();
    let d = tensor::<Autodiff<X>, 3>(dout, [ba.max(bb), m, n], dtype, device);
    let out = lhs.clone().matmul(rhs.clone());
    let grads = (out.clone() * d).sum().backward();
    // The leaves are the (possibly transposed) views: their gradients are
    // in the logical layout.
    (
        values(out.inner()),
        values(lhs.grad(&grads).expect("lhs grad")),
        values(rhs.grad(&grads).expect("rhs grad")),
    )
}

/// Sums `[batch, r, c]` over the batch when the operand was broadcast.
fn reduce_batch(g: Vec<f64>, batch: usize, own: usize, len: usize) -> Vec<f64> {
    if own == batch {
        return g;
    }
    (0..len)
        .map(|i| (0..batch).map(|bi| g[bi * len + i]).sum())
        .collect()
}

/// One case at one dtype, Bastile against the f64 reference (values and
/// both gradients); with `with_inner`, the inner backend's own matmul too.
#[allow(clippy::too_many_arguments)]
fn check_case<B: KernelBackend + BastileBackend>(
    rng: &mut Rng,
    seed: u64,
    name: &str,
    dtype: DType,
    case: Case,
    with_inner: bool,
    device: &B::Device,
) {
    let started = std::time::Instant::now();
    let [m, k, n] = case.mkn;
    let (ba, bb) = case.batch;
    let batch = ba.max(bb);
    let a = randn(rng, ba * m * k, 0.0, 1.0, dtype);
    let b = randn(rng, bb * k * n, 0.0, 1.0, dtype);
    let dout = randn(rng, batch * m * n, 0.0, 1.0, dtype);
    let (ta, tb) = case.transposed;
    let out_ref = mm(&a, &b, case.batch, m, k, n, ta, tb);
    // dlhs = dout · rhsᵀ; drhs = lhsᵀ · dout (batch-summed when
    // broadcast), from the operands in logical row-major layout.
    let rhs_logical: Vec<f64> = mm(&b, &identity(n), (bb, 1), k, n, n, tb, false);
    let dlhs_ref = reduce_batch(
        mm(&dout, &rhs_logical, (batch, bb), m, n, k, false, true),
        batch,
        ba,
        m * k,
    );
    let a_logical: Vec<f64> = mm(&a, &identity(k), (ba, 1), m, k, k, ta, false);
    let drhs_ref = reduce_batch(
        mm(&a_logical, &dout, (ba, batch), k, m, n, true, false),
        batch,
        bb,
        k * n,
    );
    let inputs = (a.as_slice(), b.as_slice(), dout.as_slice());
    let fused = run::<Bastile<B>>(case, inputs, dtype, device);
    // bf16/f16 outputs are rounded once; K-long f32 sums of unit normals
    // add ~sqrt(K) ulps on top.
    let tol = tolerance(kdtype(dtype));
    let what = format!("{name} {dtype:?} {case:?}");
    assert_close(&format!("out {what}"), &fused.0, &out_ref, tol, seed);
    assert_close(&format!("dlhs {what}"), &fused.1, &dlhs_ref, tol, seed);
    assert_close(&format!("drhs {what}"), &fused.2, &drhs_ref, tol, seed);
    if with_inner {
        let inner = run::<B>(case, inputs, dtype, device);
        // Burn's own CUDA f32 matmul uses TF32 (~1e-3 relative).
        let inner_tol = if name.starts_with("cuda") {
            tol.max(4e-3)
        } else {
            tol
        };
        let refs = [&out_ref, &dlhs_ref, &drhs_ref];
        let got = [&inner.0, &inner.1, &inner.2];
        for ((label, got), want) in ["out", "dlhs", "drhs"].iter().zip(got).zip(refs) {
            assert_close(&format!("inner {label} {what}"), got, want, inner_tol, seed);
        }
    }
    eprintln!("{what}: {:.1} s", started.elapsed().as_secs_f64());
}

/// The layout-heavy cases (transposed views, batch broadcast both ways).
const LAYOUT_CASES: std::ops::Range<usize> = 5..8;

backend_test! {
    fn matmul_and_linear_match_reference_under_autodiff<B>(device, name, dtypes) {
        let cuda = name.starts_with("cuda");
        let mut rng = Rng::fresh();
        let seed = rng.seed();
        // Elsewhere Bastile forwards to the inner backend's matmul: one dtype
        // and the layout-heavy cases check the forwarding (software Vulkan
        // is slow at every new matmul shape).
        let (dtypes, cases): (&[DType], &[Case]) = if cuda {
            (dtypes, &CASES)
        } else {
            (&dtypes[..1], &CASES[LAYOUT_CASES])
        };
        for (di, &dtype) in dtypes.iter().enumerate() {
            // On CUDA the BLAS path must be there; elsewhere it must not
            // claim to be.
            assert_eq!(
                B::ask(device, &bastile::fused::MatmulQuery { dtype }) == Some(true),
                cuda,
                "{name} {dtype:?}: BLAS path availability"
            );
            for (ci, &case) in cases.iter().enumerate() {
                // Burn's own matmul autotunes every new shape (minutes for
                // the whole list on CUDA): it is compared at the first dtype
                // on the layout-heavy cases (off CUDA on the direct backend,
                // where Bastile's result is the same Burn matmul anyway).
                let with_inner =
                    di == 0 && (!cuda || LAYOUT_CASES.contains(&ci)) && checks_composite(name);
                check_case::<B>(&mut rng, seed, name, dtype, case, with_inner, device);
            }
            linear_matches::<B>(&mut rng, seed, name, dtype, device);
        }
        if cuda {
            // The fallback ordering (host synchronization around a stream
            // of cuBLASLt's own) gives the same results.
            bastile::matmul_host_sync(true);
            for &case in &CASES[LAYOUT_CASES] {
                check_case::<B>(&mut rng, seed, name, DType::BF16, case, false, device);
            }
            bastile::matmul_host_sync(false);
            tf32_is_opt_in::<B>(&mut rng, device);
            queued_products_keep_their_operands::<B>(&mut rng, seed, name, device);
        }
    }
}

/// On CUDA a product is queued on CubeCL's device thread and the caller
/// goes on at once. Each product here reads operands the caller drops
/// right after queuing it, while fresh tensors of the same sizes (which
/// may take freed memory) are filled before any result is read; more
/// products than that thread's queue holds are queued in a row. The left
/// operands are row slices at odd byte offsets: the alignment the path
/// settles before the device thread sees the buffers' addresses.
fn queued_products_keep_their_operands<B: KernelBackend + BastileBackend>(
    rng: &mut Rng,
    seed: u64,
    name: &str,
    device: &B::Device,
) {
    type X<B> = Bastile<B>;
    let (m, k, n, count) = (33, 45, 70, 80);
    let dtype = DType::BF16;
    let mut results = Vec::new();
    let mut fills = Vec::new();
    for i in 0..count {
        let a = randn(rng, (m + 1) * k, 0.0, 1.0, dtype);
        let b = randn(rng, k * n, 0.0, 1.0, dtype);
        let lhs = tensor::<X<B>, 2>(&a, [m + 1, k], dtype, device).narrow(0, 1, m);
        let rhs = tensor::<X<B>, 2>(&b, [k, n], dtype, device);
        results.push((
            lhs.matmul(rhs),
            mm(&a[k..], &b, (1, 1), m, k, n, false, false),
        ));
        let fill = vec![i as f64; (m + 1) * k];
        fills.push(tensor::<X<B>, 2>(&fill, [m + 1, k], dtype, device));
    }
    let tol = tolerance(kdtype(dtype));
    for (i, (out, reference)) in results.into_iter().enumerate() {
        let what = format!("queued product {i} of {count} {name}");
        assert_close(&what, &values(out), &reference, tol, seed);
    }
    drop(fills);
}

fn identity(n: usize) -> Vec<f64> {
    (0..n * n)
        .map(|i| if i / n == i % n { 1.0 } else { 0.0 })
        .collect()
}

/// `burn::tensor::module::linear` with bias on a `[2, 13, in]` input:
/// output and the three gradients.
fn linear_matches<B: KernelBackend + BastileBackend>(
    rng: &mut Rng,
    seed: u64,
    name: &str,
    dtype: DType,
    device: &B::Device,
) {
    type X<B> = Autodiff<Bastile<B>>;
    let (rows, d_in, d_out) = (26, 45, 70);
    let x = randn(rng, rows * d_in, 0.0, 1.0, dtype);
    let w = randn(rng, d_in * d_out, 0.0, 1.0, dtype);
    let bias = randn(rng, d_out, 0.0, 1.0, dtype);
    let dy = randn(rng, rows * d_out, 0.0, 1.0, dtype);
    let xt = tensor::<X<B>, 3>(&x, [2, rows / 2, d_in], dtype, device).require_grad();
    let wt = tensor::<X<B>, 2>(&w, [d_in, d_out], dtype, device).require_grad();
    let bt = tensor::<X<B>, 1>(&bias, [d_out], dtype, device).require_grad();
    let y = burn::tensor::module::linear(xt.clone(), wt.clone(), Some(bt.clone()));
    let d = tensor::<X<B>, 3>(&dy, [2, rows / 2, d_out], dtype, device);
    let grads = (y.clone() * d).sum().backward();

    let mut y_ref = mm(&x, &w, (1, 1), rows, d_in, d_out, false, false);
    for (i, v) in y_ref.iter_mut().enumerate() {
        *v += bias[i % d_out];
    }
    let dx_ref = mm(&dy, &w, (1, 1), rows, d_out, d_in, false, true);
    let dw_ref = mm(&x, &dy, (1, 1), d_in, rows, d_out, true, false);
    let db_ref: Vec<f64> = (0..d_out)
        .map(|j| (0..rows).map(|r| dy[r * d_out + j]).sum())
        .collect();
    let tol = tolerance(kdtype(dtype));
    let what = format!("linear {name} {dtype:?}");
    assert_close(&format!("{what} y"), &values(y.inner()), &y_ref, tol, seed);
    assert_close(
        &format!("{what} dx"),
        &values(xt.grad(&grads).unwrap()),
        &dx_ref,
        tol,
        seed,
    );
    assert_close(
        &format!("{what} dw"),
        &values(wt.grad(&grads).unwrap()),
        &dw_ref,
        tol,
        seed,
    );
    assert_close(
        &format!("{what} db"),
        &values(bt.grad(&grads).unwrap()),
        &db_ref,
        tol,
        seed,
    );
}

/// f32 stays f32 by default; `allow_tf32` trades precision for speed.
fn tf32_is_opt_in<B: KernelBackend + BastileBackend>(rng: &mut Rng, device: &B::Device) {
    let (m, k, n) = (64, 1024, 64);
    let a = randn(rng, m * k, 0.0, 1.0, DType::F32);
    let b = randn(rng, k * n, 0.0, 1.0, DType::F32);
    let expected = mm(&a, &b, (1, 1), m, k, n, false, false);
    let error = || {
        let l = tensor::<Bastile<B>, 2>(&a, [m, k], DType::F32, device);
        let r = tensor::<Bastile<B>, 2>(&b, [k, n], DType::F32, device);
        bastile_cubecl::testing::rel_l2(&values(l.matmul(r)), &expected)
    };
    let exact = error();
    bastile::allow_tf32(true);
    let tf32 = error();
    bastile::allow_tf32(false);
    assert!(exact < 1e-6, "f32 matmul error {exact:.3e} without TF32");
    assert!(
        tf32 > 1e-5 && tf32 < 1e-2,
        "TF32 error {tf32:.3e}: TF32 not taken or broken"
    );
    assert!(
        (error() - exact).abs() < 1e-9,
        "allow_tf32(false) did not restore f32"
    );
}

#[test]
fn mismatched_shapes_get_burns_error() {
    let device = Default::default();
    type X = Bastile<burn::backend::NdArray>;
    let l = Tensor::<X, 2>::zeros([3, 4], &device);
    let r = Tensor::<X, 2>::zeros([5, 2], &device);
    let err = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| l.matmul(r)))
        .expect_err("shapes do not multiply");
    let msg = err
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| err.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default();
    assert!(msg.contains("Matmul"), "unexpected message: {msg}");
}
