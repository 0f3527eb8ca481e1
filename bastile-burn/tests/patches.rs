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
    assert_eq!(patched_ops(), vec![Op::RmsNorm], "every op starts on");

    reset();
    assert!(patched_ops().is_empty());
    apply(Patches { rms_norm: true });
    assert_eq!(patched_ops(), vec![Op::RmsNorm]);
    apply(Patches::none());
    assert!(patched_ops().is_empty());
    assert_eq!(Op::RmsNorm.to_string(), "rms_norm");

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
        apply(Patches::default());
    }
}
