//! The run-time switchboard. In its own test binary: the switches are
//! process-wide and the other tests expect every op on.

use bastile::nn::RmsNormConfig;
use bastile::{Bastile, BastileBackend, Op, Patches, apply, patched_ops, reset};
use burn::backend::NdArray;
use burn::tensor::{DType, Tensor};

#[cfg(feature = "wgpu")]
type Gpu = burn::backend::Wgpu;

#[test]
fn switches_turn_the_fused_path_on_and_off() {
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
            "fused_linear_cross_entropy",
            "matmul",
            "attention"
        ]
    );
    apply(Patches {
        cross_entropy: true,
        fused_linear_cross_entropy: true,
        ..Patches::none()
    });
    assert_eq!(
        patched_ops(),
        vec![Op::CrossEntropy, Op::FusedLinearCrossEntropy]
    );

    // NdArray has no kernels: never fused, whatever the switches say.
    apply(Patches::default());
    assert!(!<Bastile<NdArray> as BastileBackend>::rms_norm_fused(
        &Default::default(),
        64,
        DType::F32
    ));

    #[cfg(feature = "wgpu")]
    if bastile_cubecl::testing::runtime_selected("wgpu", true) {
        let device = Default::default();
        assert!(<Bastile<Gpu> as BastileBackend>::rms_norm_fused(
            &device,
            64,
            DType::F32
        ));
        let norm = RmsNormConfig::new(64).init::<Bastile<Gpu>>(&device);
        let x = Tensor::<Bastile<Gpu>, 2>::random(
            [7, 64],
            burn::tensor::Distribution::Default,
            &device,
        );
        let fused = norm.forward(x.clone());
        reset();
        assert!(!<Bastile<Gpu> as BastileBackend>::rms_norm_fused(
            &device,
            64,
            DType::F32
        ));
        let composite = norm.forward(x);
        let diff = (fused - composite).abs().max().into_scalar();
        assert!(diff < 1e-5, "fused and composite differ by {diff}");

        // Each element-wise op follows its own switch.
        apply(Patches {
            swiglu: true,
            ..Patches::none()
        });
        let fused = |d| {
            [
                <Bastile<Gpu> as BastileBackend>::swiglu_fused(&device, d),
                <Bastile<Gpu> as BastileBackend>::geglu_oss_fused(&device, d),
                <Bastile<Gpu> as BastileBackend>::rope_fused(&device, d),
                <Bastile<Gpu> as BastileBackend>::cross_entropy_fused(&device, d),
                <Bastile<Gpu> as BastileBackend>::linear_cross_entropy_fused(&device, d),
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
            fused_linear_cross_entropy: true,
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
