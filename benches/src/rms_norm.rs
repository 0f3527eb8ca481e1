//! RMSNorm: fused kernels against Burn's composite, forward, backward and a
//! training-style forward + backward through `Autodiff`.

use bastile::ops::rms_norm::{RmsNorm, RmsNormBackward};
use bastile::{Bastile, BastileBackend, RmsNormCast};
use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Distribution, Tensor, TensorPrimitive};

use crate::Args;
use crate::report::Report;
use crate::timing::median_seconds;

const EPS: f64 = 1e-6;

struct Set<B: Backend> {
    x: FloatTensor<B>,
    dy: FloatTensor<B>,
}

fn prim<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

pub fn bench<B>(device: &B::Device, args: &Args, report: &mut Report)
where
    B: bastile::ops::KernelBackend + BastileBackend,
{
    let shapes: &[(usize, usize)] = if args.tiny {
        &[(256, 1024), (512, 2048)]
    } else {
        &[(4096, 4096), (16384, 4096), (8192, 1024), (32768, 2048)]
    };
    // The software Vulkan driver has no bf16.
    let dtype = if args.tiny { DType::F32 } else { DType::BF16 };
    let elem = dtype.size() as u64;
    let dname = format!("{dtype:?}").to_lowercase();
    for &(rows, hidden) in shapes {
        let shape = format!("{rows}×{hidden}");
        // Enough input sets that one pass over them does not fit in L2.
        let set_bytes = (rows * hidden) as u64 * elem * 2;
        let sets = if args.tiny {
            2
        } else {
            (256u64 << 20).div_ceil(set_bytes).clamp(2, 8) as usize
        };
        let data: Vec<Set<B>> = (0..sets)
            .map(|_| Set {
                x: prim(
                    Tensor::<B, 2>::random([rows, hidden], Distribution::Normal(0.0, 1.0), device)
                        .cast(dtype),
                ),
                dy: prim(
                    Tensor::<B, 2>::random([rows, hidden], Distribution::Normal(0.0, 1.0), device)
                        .cast(dtype),
                ),
            })
            .collect();
        let gamma = prim(
            Tensor::<B, 1>::random([hidden], Distribution::Normal(1.0, 0.1), device).cast(dtype),
        );
        let (n, h) = (rows as u64, hidden as u64);
        let fwd_bytes = 2 * n * h * elem + h * elem + 4 * n;
        let bwd_bytes = 3 * n * h * elem + 2 * h * elem + 4 * n;
        let iters = if args.tiny { 2 } else { 20 };
        let sync = || {
            B::sync(device).expect("device sync");
        };

        for (name, fused) in [("bastile", true), ("burn", false)] {
            let forward = |x: FloatTensor<B>| {
                let op = RmsNorm {
                    eps: EPS,
                    cast: RmsNormCast::Llama,
                };
                if fused {
                    Bastile::<B>::run(&op, (x, gamma.clone()))
                } else {
                    B::run(&op, (x, gamma.clone()))
                }
            };
            let t = median_seconds(
                args.samples,
                iters,
                |i| forward(data[i % sets].x.clone()),
                sync,
            );
            report.push("rms_norm", &shape, &dname, "forward", name, t, fwd_bytes);

            let rstd: Vec<_> = data.iter().map(|s| forward(s.x.clone()).1).collect();
            let t = median_seconds(
                args.samples,
                iters,
                |i| {
                    let s = &data[i % sets];
                    let (x, g, r, dy) = (
                        s.x.clone(),
                        gamma.clone(),
                        rstd[i % sets].clone(),
                        s.dy.clone(),
                    );
                    let op = RmsNormBackward {
                        cast: RmsNormCast::Llama,
                    };
                    if fused {
                        Bastile::<B>::run(&op, (x, g, r, dy))
                    } else {
                        B::run(&op, (x, g, r, dy))
                    }
                },
                sync,
            );
            report.push("rms_norm", &shape, &dname, "backward", name, t, bwd_bytes);

            let t = median_seconds(
                args.samples,
                iters,
                |i| {
                    let s = &data[i % sets];
                    let kept: Box<dyn std::any::Any> = if fused {
                        Box::new(train_step::<Bastile<B>>(
                            s.x.clone(),
                            gamma.clone(),
                            s.dy.clone(),
                        ))
                    } else {
                        Box::new(train_step::<B>(s.x.clone(), gamma.clone(), s.dy.clone()))
                    };
                    kept
                },
                sync,
            );
            report.push(
                "rms_norm",
                &shape,
                &dname,
                "fwd+bwd (autodiff)",
                name,
                t,
                fwd_bytes + bwd_bytes,
            );
        }
    }
}

/// One forward + backward through `Autodiff<X>` with `dy` as output
/// gradient; returns the gradients (to be held until the device is done).
fn train_step<X: BastileBackend>(
    x: FloatTensor<X>,
    gamma: FloatTensor<X>,
    dy: FloatTensor<X>,
) -> (Option<Tensor<X, 2>>, Option<Tensor<X, 1>>) {
    type A<X> = Autodiff<X>;
    let x = Tensor::<A<X>, 2>::from_inner(Tensor::from_primitive(TensorPrimitive::Float(x)))
        .require_grad();
    let g = Tensor::<A<X>, 1>::from_inner(Tensor::from_primitive(TensorPrimitive::Float(gamma)))
        .require_grad();
    let dy = Tensor::<A<X>, 2>::from_inner(Tensor::from_primitive(TensorPrimitive::Float(dy)));
    let y = bastile::rms_norm(x.clone(), g.clone(), EPS, RmsNormCast::Llama).expect("valid shapes");
    let grads = (y * dy).sum().backward();
    (x.grad(&grads), g.grad(&grads))
}
