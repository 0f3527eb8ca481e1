//! Matmul: `Bastile<B>` (cuBLASLt on CUDA) against `B`'s own matmul, in
//! TFLOP/s, for the shapes a transformer trains with (a small projection
//! among them, where the fixed cost per call shows).

use bastile::Bastile;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Distribution, Tensor};

use crate::Args;
use crate::report::{MatmulRow, Report};
use crate::timing::median_seconds;

/// `(name, batch, m, k, n)`.
type Shape = (&'static str, usize, usize, usize, usize);

const SHAPES: [Shape; 6] = [
    ("square", 1, 8192, 8192, 8192),
    ("mlp", 1, 16384, 4096, 4096),
    ("lm_head", 1, 8192, 1024, 151936),
    ("qwen3-0.6b q_proj", 1, 4096, 1024, 2048),
    ("attn scores", 16, 4096, 128, 4096),
    ("attn values", 16, 4096, 4096, 128),
];

const TINY: [Shape; 2] = [("square", 1, 96, 96, 96), ("batched", 4, 33, 17, 40)];

/// Calls per timed sample: enough that a sample holds ~2 TFLOP of work, so
/// the closing synchronization does not weigh on small shapes (the rate of
/// a stream of calls, as in training); at least 3. `matmul_torch.py` uses
/// the same rule.
fn iters(flops: f64) -> usize {
    ((2e12 / flops).ceil() as usize).clamp(3, 64)
}

fn flops((_, b, m, k, n): Shape) -> f64 {
    2.0 * (b * m * k * n) as f64
}

fn time<X: Backend>(shape: Shape, dtype: DType, samples: usize, device: &X::Device) -> f64 {
    let (_, b, m, k, n) = shape;
    let lhs = Tensor::<X, 3>::random([b, m, k], Distribution::Normal(0.0, 1.0), device).cast(dtype);
    let rhs = Tensor::<X, 3>::random([b, k, n], Distribution::Normal(0.0, 1.0), device).cast(dtype);
    median_seconds(
        samples,
        iters(flops(shape)),
        |_| lhs.clone().matmul(rhs.clone()),
        || X::sync(device).expect("device sync"),
    )
}

pub fn bench<B>(device: &B::Device, args: &Args, report: &mut Report)
where
    B: bastile::ops::KernelBackend + bastile::BastileBackend,
{
    let (shapes, dtype): (&[Shape], _) = if args.tiny {
        (&TINY, DType::F32)
    } else {
        (&SHAPES, DType::BF16)
    };
    for &shape in shapes {
        let (name, b, m, k, n) = shape;
        let flops = flops(shape);
        for implementation in ["bastile", "burn"] {
            let t = if implementation == "bastile" {
                time::<Bastile<B>>(shape, dtype, args.samples, device)
            } else {
                time::<B>(shape, dtype, args.samples, device)
            };
            let row = MatmulRow {
                shape: format!("{name} {b}×{m}×{k}×{n}"),
                dtype: format!("{dtype:?}").to_lowercase(),
                implementation: implementation.into(),
                ms: t * 1e3,
                tflops: flops / t / 1e12,
            };
            crate::progress::log(format!(
                "matmul {:<34} {:<8} {:>9.3} ms {:>7.1} TFLOP/s",
                row.shape, row.implementation, row.ms, row.tflops
            ));
            report.matmul.push(row);
        }
    }
}
