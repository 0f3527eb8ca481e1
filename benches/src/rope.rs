//! RoPE: q and k in one fused launch against HF's formula in Burn ops.

use bastile::nn::{RopeScaling, rope_frequencies};
use bastile::ops::rope::Rope;
use bastile::{Bastile, BastileBackend, RopeOptions, RopeTables};
use burn::tensor::DType;

use crate::Args;
use crate::passes::{Bytes, Case, Pass, constant, grads_of, measure, random, sets_for, tracked};
use crate::report::Report;

pub fn bench<B>(device: &B::Device, args: &Args, report: &mut Report)
where
    B: bastile::ops::KernelBackend + BastileBackend,
{
    // (batch, q heads, kv heads, seq, head_dim): Qwen3-like GQA.
    let shapes: &[(usize, usize, usize, usize, usize)] = if args.tiny {
        &[(1, 4, 2, 256, 64)]
    } else {
        &[
            (1, 16, 8, 4096, 128),
            (4, 16, 8, 4096, 128),
            (1, 32, 8, 16384, 64),
        ]
    };
    let dtype = if args.tiny { DType::F32 } else { DType::BF16 };
    let e = dtype.size() as u64;
    for &(b, hq, hk, s, d) in shapes {
        let (inv, scale) = rope_frequencies(d, 1e6, &RopeScaling::None).expect("valid config");
        let tables = RopeTables::<B>::new(s, &inv, scale, device);
        let tables_ad = RopeTables::<Bastile<B>>::new(s, &inv, scale, device);
        let (cos, sin) = (
            tables.cos.clone().into_primitive().tensor(),
            tables.sin.clone().into_primitive().tensor(),
        );
        let elems = (b * (hq + hk) * s * d) as u64;
        let table_bytes = (s * d / 2 * 4 * 2) as u64;
        let sets = sets_for(args, 2 * elems * e);
        let data: Vec<_> = (0..sets)
            .map(|_| {
                (
                    random::<B, 4>([b, hq, s, d], 1.0, dtype, device),
                    random::<B, 4>([b, hk, s, d], 1.0, dtype, device),
                )
            })
            .collect();
        let case = Case {
            op: "rope",
            shape: format!("b{b} hq{hq} hkv{hk} s{s} d{d}"),
            dtype,
            bytes: Bytes {
                forward: 2 * elems * e + table_bytes,
                backward: 2 * elems * e + table_bytes,
            },
        };
        let options = RopeOptions::default();
        let backward = RopeOptions {
            inverse: true,
            ..options
        };
        measure::<B>(device, args, report, &case, |pass, fused, i| {
            let (q, k) = data[i % sets].clone();
            let (c, sn) = (cos.clone(), sin.clone());
            match (pass, fused) {
                (Pass::Forward | Pass::Backward, true) => {
                    let o = if pass == Pass::Forward {
                        options
                    } else {
                        backward
                    };
                    Box::new(Bastile::<B>::run(&Rope { options: o }, (q, Some(k), c, sn)))
                }
                (Pass::Forward | Pass::Backward, false) => {
                    let o = if pass == Pass::Forward {
                        options
                    } else {
                        backward
                    };
                    Box::new(B::run(&Rope { options: o }, (q, Some(k), c, sn)))
                }
                (Pass::Train, true) => {
                    let t = RopeTables {
                        cos: constant(tables_ad.cos.clone().into_primitive().tensor()),
                        sin: constant(tables_ad.sin.clone().into_primitive().tensor()),
                    };
                    let (q, k) = (tracked::<Bastile<B>, 4>(q), tracked(k));
                    let (qo, ko) =
                        bastile::rope(q.clone(), k.clone(), &t, options).expect("valid shapes");
                    grads_of(qo.sum() + ko.sum(), &[&q, &k])
                }
                (Pass::Train, false) => {
                    let t = RopeTables {
                        cos: constant(tables.cos.clone().into_primitive().tensor()),
                        sin: constant(tables.sin.clone().into_primitive().tensor()),
                    };
                    let (q, k) = (tracked::<B, 4>(q), tracked(k));
                    let (qo, ko) =
                        bastile::rope(q.clone(), k.clone(), &t, options).expect("valid shapes");
                    grads_of(qo.sum() + ko.sum(), &[&q, &k])
                }
            }
        });
    }
}
