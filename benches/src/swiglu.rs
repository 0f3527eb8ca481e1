//! SwiGLU: the fused kernels against Burn's `silu(gate) * up`.

use bastile::ops::swiglu::{SwiGlu, SwiGluBackward};
use bastile::{Bastile, BastileBackend, GluTensors};
use burn::tensor::DType;
use burn::tensor::activation::silu;

use crate::Args;
use crate::passes::{Bytes, Case, Pass, constant, grads_of, measure, random, sets_for, tracked};
use crate::report::Report;

pub fn bench<B>(device: &B::Device, args: &Args, report: &mut Report)
where
    B: bastile::ops::KernelBackend + BastileBackend,
{
    let shapes: &[(usize, usize)] = if args.tiny {
        &[(256, 1024)]
    } else {
        &[(8192, 3072), (16384, 3072), (8192, 14336)]
    };
    let dtype = if args.tiny { DType::F32 } else { DType::BF16 };
    let e = dtype.size() as u64;
    for &(rows, inter) in shapes {
        let n = (rows * inter) as u64;
        let sets = sets_for(args, 3 * n * e);
        let data: Vec<_> = (0..sets)
            .map(|_| {
                let t = || random::<B, 2>([rows, inter], 1.0, dtype, device);
                (t(), t(), t())
            })
            .collect();
        let case = Case {
            op: "swiglu",
            shape: format!("{rows}×{inter}"),
            dtype,
            bytes: Bytes {
                forward: 3 * n * e,
                backward: 5 * n * e,
            },
        };
        measure::<B>(device, args, report, &case, |pass, fused, i| {
            let (g, u, d) = data[i % sets].clone();
            let input = GluTensors::Separate { gate: g, up: u };
            match (pass, fused) {
                (Pass::Forward, true) => Box::new(Bastile::<B>::run(&SwiGlu, input)),
                (Pass::Forward, false) => Box::new(B::run(&SwiGlu, input)),
                (Pass::Backward, true) => Box::new(Bastile::<B>::run(&SwiGluBackward, (input, d))),
                (Pass::Backward, false) => Box::new(B::run(&SwiGluBackward, (input, d))),
                (Pass::Train, true) => {
                    let GluTensors::Separate { gate, up } = input else {
                        unreachable!()
                    };
                    let (g, u) = (tracked::<Bastile<B>, 2>(gate), tracked(up));
                    let out = bastile::swiglu(g.clone(), u.clone()).expect("valid shapes");
                    grads_of((out * constant(d)).sum(), &[&g, &u])
                }
                (Pass::Train, false) => {
                    // What an unmodified Burn model computes.
                    let GluTensors::Separate { gate, up } = input else {
                        unreachable!()
                    };
                    let (g, u) = (tracked::<B, 2>(gate), tracked(up));
                    grads_of((silu(g.clone()) * u.clone() * constant(d)).sum(), &[&g, &u])
                }
            }
        });
    }
}
