//! GPT-OSS GEGLU: the fused kernels against the same math in Burn ops.

use bastile::ops::geglu::{
    GEGLU_OSS_ALPHA as ALPHA, GEGLU_OSS_LIMIT as LIMIT, GegluOss, GegluOssBackward,
};
use bastile::{Bastile, BastileBackend};

const FORWARD: GegluOss = GegluOss {
    alpha: ALPHA,
    limit: LIMIT,
};
const BACKWARD: GegluOssBackward = GegluOssBackward {
    alpha: ALPHA,
    limit: LIMIT,
};
use burn::tensor::DType;

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
        &[(8192, 2880), (32768, 2880)]
    };
    let dtype = if args.tiny { DType::F32 } else { DType::BF16 };
    let e = dtype.size() as u64;
    for &(rows, inter) in shapes {
        let n = (rows * inter) as u64;
        let sets = sets_for(args, 3 * n * e);
        let data: Vec<_> = (0..sets)
            .map(|_| {
                (
                    random::<B, 2>([rows, 2 * inter], 4.0, dtype, device),
                    random::<B, 2>([rows, inter], 1.0, dtype, device),
                )
            })
            .collect();
        let case = Case {
            op: "geglu_oss",
            shape: format!("{rows}×{inter}"),
            dtype,
            bytes: Bytes {
                forward: 3 * n * e,
                backward: 5 * n * e,
            },
        };
        measure::<B>(device, args, report, &case, |pass, fused, i| {
            let (x, d) = data[i % sets].clone();
            match (pass, fused) {
                (Pass::Forward, true) => Box::new(Bastile::<B>::run(&FORWARD, x)),
                (Pass::Forward, false) => Box::new(B::run(&FORWARD, x)),
                (Pass::Backward, true) => Box::new(Bastile::<B>::run(&BACKWARD, (x, d))),
                (Pass::Backward, false) => Box::new(B::run(&BACKWARD, (x, d))),
                (Pass::Train, true) => {
                    let x = tracked::<Bastile<B>, 2>(x);
                    let out = bastile::geglu_oss(x.clone(), ALPHA, LIMIT).expect("valid shapes");
                    grads_of((out * constant(d)).sum(), &[&x])
                }
                (Pass::Train, false) => {
                    let x = tracked::<B, 2>(x);
                    let out = bastile::geglu_oss(x.clone(), ALPHA, LIMIT).expect("valid shapes");
                    grads_of((out * constant(d)).sum(), &[&x])
                }
            }
        });
    }
}
