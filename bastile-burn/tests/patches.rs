//! The run-time switchboard. The switches are process-wide and the other
//! tests of this binary expect every op on, so the checks run in a child
//! process: the test binary started again on this one test alone.

use bastile::fused::is_fused;
use bastile::ops::rms_norm::{RmsNorm, RmsNormQuery};
use bastile::{Bastile, Op, Patches, apply, patched_ops, reset};
use burn::backend::NdArray;
use burn::tensor::DType;

#[cfg(feature = "wgpu")]
type Gpu = burn::backend::Wgpu;

/// Set in the child process that runs [`switchboard_checks`].
const CHILD: &str = "BASTILE_SWITCHBOARD_CHILD";

#[test]
fn switches_turn_the_fused_path_on_and_off() {
    if std::env::var_os(CHILD).is_some() {
        switchboard_checks();
        return;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = std::process::Command::new(exe)
        .args([
            "patches::switches_turn_the_fused_path_on_and_off",
            "--exact",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .output()
        .expect("starting the test binary again");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "the switchboard checks failed in their own process ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The checks themselves, in a process whose switches nothing else touches.
fn switchboard_checks() {
    assert_eq!(patched_ops(), Op::ALL.to_vec(), "every op starts on");

    reset();
    assert!(patched_ops().is_empty());
    apply(Patches {
        rms_norm: true,
        ..Patches::none()
    });
    assert_eq!(patched_ops(), vec![Op::RmsNorm]);
    apply(Patches {
        swiglu: true,
        rope: true,
        ..Patches::none()
    });
    assert_eq!(patched_ops(), vec![Op::SwiGlu, Op::Rope]);
    apply(Patches {
        geglu: true,
        ..Patches::none()
    });
    assert_eq!(patched_ops(), vec![Op::Geglu]);
    apply(Patches {
        matmul: true,
        ..Patches::none()
    });
    assert_eq!(patched_ops(), vec![Op::Matmul]);
    apply(Patches {
        attention: true,
        ..Patches::none()
    });
    assert_eq!(patched_ops(), vec![Op::Attention]);
    apply(Patches {
        lora: true,
        ..Patches::none()
    });
    assert_eq!(patched_ops(), vec![Op::Lora]);
    apply(Patches {
        embedding: true,
        ..Patches::none()
    });
    assert_eq!(patched_ops(), vec![Op::Embedding]);
    apply(Patches {
        moe: true,
        ..Patches::none()
    });
    assert_eq!(patched_ops(), vec![Op::Moe]);
    apply(Patches::none());
    assert!(patched_ops().is_empty());
    let names: Vec<String> = Op::ALL.iter().map(|op| op.to_string()).collect();
    assert_eq!(
        names,
        [
            "rms_norm",
            "swiglu",
            "geglu",
            "rope",
            "cross_entropy",
            "linear_cross_entropy",
            "matmul",
            "attention",
            "lora",
            "embedding",
            "moe"
        ]
    );
    apply(Patches {
        cross_entropy: true,
        linear_cross_entropy: true,
        ..Patches::none()
    });
    assert_eq!(
        patched_ops(),
        vec![Op::CrossEntropy, Op::LinearCrossEntropy]
    );

    // NdArray has no kernels: never fused, whatever the switches say.
    apply(Patches::default());
    let rms_norm = |dtype| RmsNormQuery { hidden: 64, dtype };
    let rms_norm_op = RmsNorm {
        eps: 1e-6,
        cast: bastile::RmsNormCast::Llama,
    };
    assert!(!is_fused::<Bastile<NdArray>, _>(
        &rms_norm_op,
        &Default::default(),
        &rms_norm(DType::F32)
    ));

    #[cfg(feature = "wgpu")]
    if bastile_cubecl::testing::runtime_selected("wgpu", true) {
        use bastile::fused::DTypeQuery;
        use bastile::nn::RmsNormConfig;
        use bastile::ops::cross_entropy::{CrossEntropy, CrossEntropyQuery, LossSpec};
        use bastile::ops::geglu::{GEGLU_OSS_ALPHA, GEGLU_OSS_LIMIT, GegluOss};
        use bastile::ops::linear_cross_entropy::LinearCrossEntropy;
        use bastile::ops::rope::Rope;
        use bastile::ops::swiglu::SwiGlu;
        use burn::tensor::Tensor;

        let device = Default::default();
        assert!(is_fused::<Bastile<Gpu>, _>(
            &rms_norm_op,
            &device,
            &rms_norm(DType::F32)
        ));
        let norm = RmsNormConfig::new(64).init::<Bastile<Gpu>>(&device);
        let x = Tensor::<Bastile<Gpu>, 2>::random(
            [7, 64],
            burn::tensor::Distribution::Default,
            &device,
        );
        let fused = norm.forward(x.clone());
        reset();
        assert!(!is_fused::<Bastile<Gpu>, _>(
            &rms_norm_op,
            &device,
            &rms_norm(DType::F32)
        ));
        let composite = norm.forward(x);
        let diff = (fused - composite).abs().max().into_scalar();
        assert!(diff < 1e-5, "fused and composite differ by {diff}");

        // Each element-wise op follows its own switch.
        apply(Patches {
            swiglu: true,
            ..Patches::none()
        });
        let geglu = GegluOss {
            alpha: GEGLU_OSS_ALPHA,
            limit: GEGLU_OSS_LIMIT,
        };
        let rope = Rope::default();
        let ce = CrossEntropy {
            spec: LossSpec::probe(),
        };
        let lce = LinearCrossEntropy {
            spec: LossSpec::probe(),
        };
        let fused = |d| {
            [
                is_fused::<Bastile<Gpu>, _>(&SwiGlu, &device, &DTypeQuery { dtype: d }),
                is_fused::<Bastile<Gpu>, _>(&geglu, &device, &DTypeQuery { dtype: d }),
                is_fused::<Bastile<Gpu>, _>(&rope, &device, &DTypeQuery { dtype: d }),
                is_fused::<Bastile<Gpu>, _>(&ce, &device, &CrossEntropyQuery { dtype: d }),
                is_fused::<Bastile<Gpu>, _>(&lce, &device, &CrossEntropyQuery { dtype: d }),
            ]
        };
        assert_eq!(fused(DType::F32), [true, false, false, false, false]);
        apply(Patches {
            geglu: true,
            rope: true,
            ..Patches::none()
        });
        assert_eq!(fused(DType::F32), [false, true, true, false, false]);
        apply(Patches {
            linear_cross_entropy: true,
            ..Patches::none()
        });
        assert_eq!(fused(DType::F32), [false, false, false, false, true]);
        apply(Patches {
            cross_entropy: true,
            ..Patches::none()
        });
        assert_eq!(fused(DType::F32), [false, false, false, true, false]);
        apply(Patches::default());
    }
}
