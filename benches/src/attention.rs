//! Attention: `Bastile<B>`'s fused kernels against Burn's autodiff
//! attention (the composite graph that saves the `[seq, seq]` scores),
//! forward and forward+backward, in TFLOP/s (causal FLOPs: half the score
//! matrix; the backward counted as 2.5 forwards, as flash-attention
//! benchmarks do) and peak device memory.

use bastile::{AttentionOptions, Bastile, BastileBackend, attention};
use burn::backend::Autodiff;
use burn::tensor::{DType, Distribution, Tensor};

use crate::report::{AttentionRow, Report};
use crate::timing::median_seconds;
use crate::train::TrainImpl;
use crate::{Args, progress};

/// `(batch, heads, kv_heads, head_dim)`: Qwen3's attention (16 query
/// heads of 128 over 8 key-value heads) and Llama 3.2's (32 of 64 over 8).
/// The sequence lengths come from `--seq` and `--impl burn` / `--impl
/// bastile` picks one side, so that each configuration can run in its own
/// process (Burn's side runs out of memory first).
const SHAPES: [(usize, usize, usize, usize); 2] = [(1, 16, 8, 128), (1, 32, 8, 64)];
const TINY: (usize, usize, usize, usize) = (1, 4, 2, 64);

/// The PyTorch script's name of a bench shape (`b1 hq16 hkv8 d128
/// causal` is `16x8x128`), `None` for any other text.
pub fn torch_shape(shape: &str) -> Option<String> {
    let mut dims = shape.split(' ');
    let _batch = dims.next()?.strip_prefix('b')?;
    let h = dims.next()?.strip_prefix("hq")?.parse::<usize>().ok()?;
    let hk = dims.next()?.strip_prefix("hkv")?.parse::<usize>().ok()?;
    let d = dims.next()?.strip_prefix('d')?.parse::<usize>().ok()?;
    Some(format!("{h}x{hk}x{d}"))
}

fn inputs<X: BastileBackend>(
    seq: usize,
    shape: (usize, usize, usize, usize),
    dtype: DType,
    device: &X::Device,
) -> [Tensor<X, 4>; 3] {
    let (b, h, hk, d) = shape;
    let n = Distribution::Normal(0.0, 1.0);
    [
        Tensor::<X, 4>::random([b, h, seq, d], n, device).cast(dtype),
        Tensor::<X, 4>::random([b, hk, seq, d], n, device).cast(dtype),
        Tensor::<X, 4>::random([b, hk, seq, d], n, device).cast(dtype),
    ]
}

const CAUSAL: AttentionOptions = AttentionOptions {
    scale: None,
    causal: true,
    window: None,
};

fn forward<X: BastileBackend>(x: &[Tensor<X, 4>; 3]) -> Tensor<X, 4> {
    let [q, k, v] = x.clone();
    attention(q, k, v, None, None, None, CAUSAL).expect("valid attention")
}

fn forward_backward<X: BastileBackend>(x: &[Tensor<Autodiff<X>, 4>; 3]) -> impl Sized {
    let [q, k, v] = x.clone().map(|t| t.require_grad());
    let out = attention(q, k, v, None, None, None, CAUSAL).expect("valid attention");
    // Seeded with ones, the gradient `out.sum()` would pass down, without
    // timing the sum and its backward; the PyTorch script seeds the same way.
    out.backward()
}

/// Times one implementation at one length: `(fwd s, fwd+bwd s, peak MiB)`.
fn measure<R, X>(
    seq: usize,
    shape: (usize, usize, usize, usize),
    dtype: DType,
    samples: usize,
    calls: usize,
    device: &X::Device,
) -> (f64, f64, f64)
where
    R: cubecl::Runtime<Device = X::Device>,
    X: BastileBackend,
{
    let client = R::client(device);
    let reserved = || client.memory_usage().map(|u| u.bytes_reserved).unwrap_or(0) as f64;
    let sync = || X::sync(device).expect("device sync");
    let x = inputs::<X>(seq, shape, dtype, device);
    let fwd = median_seconds(samples, calls, |_| forward(&x), sync);
    let xa = x.map(Tensor::<Autodiff<X>, 4>::from_inner);
    // Tune and warm, release the pool's free blocks, then read the peak
    // of one call.
    drop(forward_backward(&xa));
    sync();
    X::memory_cleanup(device);
    sync();
    drop(forward_backward(&xa));
    sync();
    let peak = reserved() / (1u64 << 20) as f64;
    let both = median_seconds(samples, calls, |_| forward_backward(&xa), sync);
    (fwd, both, peak)
}

pub fn bench<R, B>(device: &B::Device, args: &Args, report: &mut Report)
where
    R: cubecl::Runtime<Device = B::Device>,
    B: bastile::ops::KernelBackend + BastileBackend,
{
    let (shapes, dtype, seqs) = if args.tiny {
        (vec![TINY], DType::F32, vec![64, 200])
    } else {
        (
            SHAPES.to_vec(),
            DType::BF16,
            args.seq
                .clone()
                .unwrap_or_else(|| vec![2048, 4096, 8192, 16384]),
        )
    };
    for shape in shapes {
        bench_shape::<R, B>(shape, dtype, &seqs, device, args, report);
    }
}

fn bench_shape<R, B>(
    shape: (usize, usize, usize, usize),
    dtype: DType,
    seqs: &[usize],
    device: &B::Device,
    args: &Args,
    report: &mut Report,
) where
    R: cubecl::Runtime<Device = B::Device>,
    B: bastile::ops::KernelBackend + BastileBackend,
{
    let (b, h, hk, d) = shape;
    let samples = args.samples.clamp(1, 10);
    let calls = args.calls.max(1);
    // Burn's attention saves `[seq, seq]` scores and runs out of memory at
    // long sequences; its first failure ends its side of the sweep.
    let mut failed: Vec<&str> = Vec::new();
    for &seq in seqs {
        let causal_fwd = 4.0 * (b * h * d) as f64 * (seq * seq) as f64 / 2.0;
        for implementation in ["bastile", "burn"] {
            // `bastile` and `bastile (Burn matmul)` both name our side.
            let wanted = args.implementation.is_empty()
                || args
                    .implementation
                    .iter()
                    .any(|&i| (i == TrainImpl::Burn) == (implementation == "burn"));
            if !wanted || failed.contains(&implementation) {
                continue;
            }
            let measured = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                if implementation == "bastile" {
                    measure::<R, Bastile<B>>(seq, shape, dtype, samples, calls, device)
                } else {
                    measure::<R, B>(seq, shape, dtype, samples, calls, device)
                }
            }));
            let mut row = AttentionRow {
                shape: format!("b{b} hq{h} hkv{hk} d{d} causal"),
                seq,
                dtype: format!("{dtype:?}").to_lowercase(),
                implementation: implementation.into(),
                fwd_ms: f64::NAN,
                fwd_tflops: f64::NAN,
                fwd_bwd_ms: f64::NAN,
                fwd_bwd_tflops: f64::NAN,
                peak_mib: f64::NAN,
                error: None,
            };
            let Ok((fwd, both, peak)) = measured else {
                progress::log(format!(
                    "attention hq{h} d{d} seq {seq}: {implementation} failed (out of memory?); longer sequences skipped"
                ));
                row.error = Some("failed (panicked; the log says why)".into());
                report.attention.push(row);
                failed.push(implementation);
                B::memory_cleanup(device);
                continue;
            };
            row.fwd_ms = fwd * 1e3;
            row.fwd_tflops = causal_fwd / fwd / 1e12;
            row.fwd_bwd_ms = both * 1e3;
            row.fwd_bwd_tflops = 3.5 * causal_fwd / both / 1e12;
            row.peak_mib = peak;
            progress::log(format!(
                "attention hq{h} d{d} seq {:>6} {:<8} fwd {:>9.3} ms {:>6.1} TFLOP/s  fwd+bwd {:>9.3} ms {:>6.1} TFLOP/s  peak {:>8.0} MiB",
                row.seq,
                row.implementation,
                row.fwd_ms,
                row.fwd_tflops,
                row.fwd_bwd_ms,
                row.fwd_bwd_tflops,
                row.peak_mib
            ));
            report.attention.push(row);
        }
    }
}
