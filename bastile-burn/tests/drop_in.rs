//! `bastile::nn::RmsNorm` is a drop-in for `burn::nn::RmsNorm`: a record
//! saved from Burn's module loads into Bastile's and both compute the same.

use bastile::Bastile;
use burn::backend::NdArray;
use burn::module::Module;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::{Distribution, Tensor};

type B = Bastile<NdArray>;

#[test]
fn burn_rms_norm_record_loads_into_bastile_rms_norm() {
    let device = Default::default();
    let burn_norm = burn::nn::RmsNormConfig::new(48)
        .with_epsilon(1e-6)
        .init::<B>(&device);
    // A non-trivial gamma, so loading is observable.
    let gamma = Tensor::<B, 1>::random([48], Distribution::Normal(1.0, 0.3), &device);
    let burn_norm = burn::nn::RmsNorm {
        gamma: burn::module::Param::from_tensor(gamma.clone()),
        ..burn_norm
    };

    let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
    let bytes = recorder
        .record(burn_norm.clone().into_record(), ())
        .unwrap();
    let record = recorder
        .load(bytes, &device)
        .expect("Burn's record loads into Bastile's module");
    // As in Burn, constants such as epsilon come from the config, not the record.
    let ours = bastile::nn::RmsNormConfig::new(48)
        .with_epsilon(1e-6)
        .init::<B>(&device)
        .load_record(record);
    let diff = (ours.gamma.val() - gamma).abs().max().into_scalar();
    assert_eq!(diff, 0.0, "gamma must load unchanged");

    let x = Tensor::<B, 3>::random([2, 9, 48], Distribution::Normal(0.0, 2.0), &device);
    let expected = burn_norm.forward(x.clone());
    let actual = ours.forward(x);
    let err = (actual - expected).abs().max().into_scalar();
    assert!(err < 1e-5, "bastile and burn RmsNorm differ by {err}");
}

#[test]
fn invalid_config_is_an_error() {
    let device = Default::default();
    let err = bastile::nn::RmsNormConfig::new(8)
        .with_epsilon(-1.0)
        .try_init::<B>(&device)
        .unwrap_err();
    assert!(err.to_string().contains("epsilon"), "{err}");
    let err = bastile::nn::RmsNormConfig::new(0)
        .try_init::<B>(&device)
        .unwrap_err();
    assert!(err.to_string().contains("d_model"), "{err}");
}
