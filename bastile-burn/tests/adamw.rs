//! The fused AdamW (`bastile::optim::AdamW`) against the f64 reference and
//! Burn's own AdamW over several steps, fused (`Autodiff<Bastile<B>>`) and
//! composite (`Autodiff<B>`): f32 parameters within 1e-6, clipping when it
//! binds and when it does not, weight decay and bias correction; half
//! parameters with f32 master weights follow the f32 run; the state saves,
//! loads and resumes identically; a non-finite gradient changes nothing;
//! bad settings are errors.

use bastile::optim::{AdamW, AdamWConfig};
use bastile::{Bastile, BastileBackend, BastileError};
use bastile_cubecl::FloatDtype;
use bastile_cubecl::adamw::AdamWStep;
use bastile_cubecl::reference::adamw::{ParamState, clip_scale, global_norm};
use bastile_cubecl::testing::{Rng, rel_l2, round_to, tolerance};
use burn::backend::{Autodiff, NdArray};
use burn::module::{Module, Param};
use burn::optim::{AdamWConfig as BurnAdamWConfig, GradientsParams, Optimizer};
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Bool, DType, Tensor};

use crate::common::*;

/// Parameters of three ranks, one of a length no vector width divides.
#[derive(Module, Debug)]
struct Weights<B: Backend> {
    a: Param<Tensor<B, 2>>,
    b: Param<Tensor<B, 1>>,
    c: Param<Tensor<B, 3>>,
}

const SHAPES: [&[usize]; 3] = [&[5, 7], &[1003], &[2, 3, 5]];

/// The initial values of the three parameters and, per step, their
/// gradients: `loss = Σ w·g` makes the gradient exactly `g`.
struct Data {
    init: Vec<Vec<f64>>,
    grads: Vec<Vec<Vec<f64>>>,
}

fn data(rng: &mut Rng, steps: usize, dtype: DType) -> Data {
    let n = |s: &[usize]| s.iter().product::<usize>();
    Data {
        init: SHAPES
            .iter()
            .map(|s| randn(rng, n(s), 0.0, 1.0, dtype))
            .collect(),
        grads: (0..steps)
            .map(|_| {
                SHAPES
                    .iter()
                    .map(|s| randn(rng, n(s), 0.0, 0.3, dtype))
                    .collect()
            })
            .collect(),
    }
}

fn weights<B: Backend>(init: &[Vec<f64>], dtype: DType, device: &B::Device) -> Weights<B> {
    Weights {
        a: Param::from_tensor(tensor(&init[0], [5, 7], dtype, device)),
        b: Param::from_tensor(tensor(&init[1], [1003], dtype, device)),
        c: Param::from_tensor(tensor(&init[2], [2, 3, 5], dtype, device)),
    }
}

fn read<B: Backend>(w: &Weights<B>) -> Vec<Vec<f64>> {
    vec![values(w.a.val()), values(w.b.val()), values(w.c.val())]
}

/// The gradients of `Σ w·g` for the step's `g`.
fn grads<B: AutodiffBackend>(
    w: &Weights<B>,
    g: &[Vec<f64>],
    dtype: DType,
    device: &B::Device,
) -> GradientsParams {
    let loss = (w.a.val() * tensor(&g[0], [5, 7], dtype, device)).sum()
        + (w.b.val() * tensor(&g[1], [1003], dtype, device)).sum()
        + (w.c.val() * tensor(&g[2], [2, 3, 5], dtype, device)).sum();
    GradientsParams::from_grads(loss.cast(DType::F32).backward(), w)
}

/// Runs `steps` optimizer steps from `data` and returns the weights.
fn train<B: AutodiffBackend, O: Optimizer<Weights<B>, B>>(
    optimizer: &mut O,
    mut w: Weights<B>,
    data: &Data,
    steps: std::ops::Range<usize>,
    lr: f64,
    dtype: DType,
    device: &B::Device,
) -> Weights<B> {
    for step in steps {
        let g = grads(&w, &data.grads[step], dtype, device);
        w = optimizer.step(lr, w, g);
    }
    w
}

const LR: f64 = 0.05;

fn config(max_grad_norm: Option<f64>, weight_decay: f64) -> AdamWConfig {
    AdamWConfig::new()
        .with_max_grad_norm(max_grad_norm)
        .with_weight_decay(weight_decay)
}

/// The f64 reference: the weights after every step of `data`.
fn reference(
    data: &Data,
    config: &AdamWConfig,
    round: impl Fn(f64) -> f64 + Copy,
) -> Vec<Vec<f64>> {
    let mut states: Vec<ParamState> = data.init.iter().cloned().map(ParamState::new).collect();
    for (t, g) in data.grads.iter().enumerate() {
        let norm = global_norm(&g.iter().map(Vec::as_slice).collect::<Vec<_>>());
        let scale = clip_scale(norm, config.max_grad_norm);
        let hyper = AdamWStep {
            learning_rate: LR,
            beta1: config.beta1,
            beta2: config.beta2,
            epsilon: config.epsilon,
            weight_decay: config.weight_decay,
            step: t as u64 + 1,
        };
        for (s, g) in states.iter_mut().zip(g) {
            s.step(g, scale, &hyper, round, round);
        }
    }
    states.into_iter().map(|s| s.weights).collect()
}

fn assert_params(what: &str, actual: &[Vec<f64>], expected: &[Vec<f64>], bound: f64) {
    for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
        let err = rel_l2(a, e);
        assert!(
            err <= bound,
            "{what}: parameter {i}: relative L2 error {err:.3e} (bound {bound:.0e})"
        );
    }
}

/// f32: the fused and composite steps against the f64 reference (clipping
/// off, binding and not) and against Burn's AdamW.
fn f32_steps<B: AutodiffBackend>(name: &str, device: &B::Device, rng: &mut Rng)
where
    B::InnerBackend: BastileBackend,
{
    let steps = 4;
    let data = data(rng, steps, DType::F32);
    let seed = rng.seed();
    for cfg in [
        config(None, 0.01),
        config(Some(0.5), 0.1),
        config(Some(1e6), 0.0),
    ] {
        let what = format!("{name} {cfg:?} seed {seed}");
        let mut optimizer = cfg.init::<B>().unwrap();
        let w = weights::<B>(&data.init, DType::F32, device);
        let w = train(&mut optimizer, w, &data, 0..steps, LR, DType::F32, device);
        let expected = reference(&data, &cfg, |x| round_to(FloatDtype::F32, x));
        assert_params(&format!("{what} against f64"), &read(&w), &expected, 1e-6);
        if cfg.max_grad_norm.is_none() {
            let mut burn_adamw = BurnAdamWConfig::new()
                .with_beta_1(cfg.beta1 as f32)
                .with_beta_2(cfg.beta2 as f32)
                .with_epsilon(cfg.epsilon as f32)
                .with_weight_decay(cfg.weight_decay as f32)
                .init::<B, Weights<B>>();
            let w = weights::<B>(&data.init, DType::F32, device);
            let burns = train(&mut burn_adamw, w, &data, 0..steps, LR, DType::F32, device);
            assert_params(
                &format!("{what} against Burn's AdamW"),
                &read(&burns),
                &expected,
                1e-6,
            );
        }
    }
}

/// Half parameters with f32 master weights follow the f32 run: the master
/// copy within f32 rounding, the parameter its rounding.
fn master_follows_f32<B: AutodiffBackend>(
    name: &str,
    dtype: DType,
    device: &B::Device,
    rng: &mut Rng,
) where
    B::InnerBackend: BastileBackend,
{
    let steps = 3;
    let data = data(rng, steps, dtype);
    let seed = rng.seed();
    let what = format!("{name} {dtype:?} master weights, seed {seed}");
    let cfg = config(Some(0.5), 0.1).with_master_weights(true);
    let expected = reference(&data, &cfg, |x| round_to(FloatDtype::F32, x));
    let mut optimizer = cfg.init::<B>().unwrap();
    let w = weights::<B>(&data.init, dtype, device);
    let w = train(&mut optimizer, w, &data, 0..steps, LR, dtype, device);
    let record = Optimizer::<Weights<B>, B>::to_record(&optimizer);
    let masters: Vec<Vec<f64>> = [w.a.id, w.b.id, w.c.id]
        .iter()
        .map(|id| {
            let state = &record.states[id];
            assert_eq!(state.moment1.dtype(), DType::F32, "{what}: moments in f32");
            values(state.master.clone().expect("a master copy"))
        })
        .collect();
    assert_params(&format!("{what}: master"), &masters, &expected, 1e-6);
    let rounded: Vec<Vec<f64>> = expected
        .iter()
        .map(|p| p.iter().map(|&x| round_to(kdtype(dtype), x)).collect())
        .collect();
    assert_params(
        &format!("{what}: parameter"),
        &read(&w),
        &rounded,
        tolerance(kdtype(dtype)),
    );
}

/// Two steps, the state saved to bytes and loaded into a new optimizer,
/// two more: the same weights as four steps without the round trip.
fn resumes<B: AutodiffBackend>(name: &str, dtype: DType, device: &B::Device, rng: &mut Rng)
where
    B::InnerBackend: BastileBackend,
{
    let data = data(rng, 4, dtype);
    let cfg = config(Some(0.5), 0.01);
    let mut straight = cfg.init::<B>().unwrap();
    let w = weights::<B>(&data.init, dtype, device);
    let expected = read(&train(&mut straight, w, &data, 0..4, LR, dtype, device));
    let mut first = cfg.init::<B>().unwrap();
    let w = weights::<B>(&data.init, dtype, device);
    let w = train(&mut first, w, &data, 0..2, LR, dtype, device);
    let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
    let bytes = recorder
        .record(Optimizer::<Weights<B>, B>::to_record(&first), ())
        .unwrap();
    let record = recorder.load(bytes, device).unwrap();
    let mut second = Optimizer::<Weights<B>, B>::load_record(cfg.init::<B>().unwrap(), record);
    assert_eq!(second.steps(), 2, "{name}: the step count is saved");
    let w = train(&mut second, w, &data, 2..4, LR, dtype, device);
    assert_eq!(read(&w), expected, "{name} {dtype:?}: resumed run differs");
}

/// A NaN or infinite gradient anywhere: the step changes no parameter and
/// no moment, and reports a non-finite norm; the next finite step updates.
fn skips_non_finite<B: AutodiffBackend>(name: &str, dtype: DType, device: &B::Device, rng: &mut Rng)
where
    B::InnerBackend: BastileBackend,
{
    for bad in [f64::NAN, f64::INFINITY] {
        let mut data = data(rng, 3, dtype);
        data.grads[1][1][500] = bad;
        let mut optimizer = config(Some(1.0), 0.1).init::<B>().unwrap();
        let w = weights::<B>(&data.init, dtype, device);
        let w = train(&mut optimizer, w, &data, 0..1, LR, dtype, device);
        let (before, state) = (read(&w), Optimizer::<Weights<B>, B>::to_record(&optimizer));
        let w = train(&mut optimizer, w, &data, 1..2, LR, dtype, device);
        let norm = values(optimizer.last_norm().unwrap())[0];
        assert!(
            !norm.is_finite(),
            "{name}: norm {norm} with a {bad} gradient"
        );
        assert_eq!(
            read(&w),
            before,
            "{name} {dtype:?}: a {bad} gradient moved the weights"
        );
        let after = Optimizer::<Weights<B>, B>::to_record(&optimizer);
        for (id, s) in &state.states {
            let a = &after.states[id];
            assert_eq!(
                values(a.moment1.clone()),
                values(s.moment1.clone()),
                "{name}: first moment"
            );
            assert_eq!(
                values(a.moment2.clone()),
                values(s.moment2.clone()),
                "{name}: second moment"
            );
        }
        let w = train(&mut optimizer, w, &data, 2..3, LR, dtype, device);
        assert!(values(optimizer.last_norm().unwrap())[0].is_finite());
        assert_ne!(read(&w), before, "{name}: the next finite step updates");
    }
}

/// A set `skip` flag changes nothing (and the step, once forgotten, does
/// not count); a clear one is an ordinary step.
fn skips_on_flag<B: AutodiffBackend>(name: &str, dtype: DType, device: &B::Device, rng: &mut Rng)
where
    B::InnerBackend: BastileBackend,
{
    let data = data(rng, 2, dtype);
    let cfg = config(Some(1.0), 0.1);
    let mut plain = cfg.init::<B>().unwrap();
    let expected = read(&train(
        &mut plain,
        weights::<B>(&data.init, dtype, device),
        &data,
        0..2,
        LR,
        dtype,
        device,
    ));
    let mut flagged = cfg.init::<B>().unwrap();
    let w = weights::<B>(&data.init, dtype, device);
    let w = train(&mut flagged, w, &data, 0..1, LR, dtype, device);
    let before = read(&w);
    let flag = |set: bool| Tensor::<B::InnerBackend, 1, Bool>::from_data([set], device);
    let g = grads(&w, &data.grads[1], dtype, device);
    let w = flagged.step_unless(LR, w, g, flag(true));
    assert_eq!(
        read(&w),
        before,
        "{name} {dtype:?}: a flagged step moved the weights"
    );
    assert!(!values(flagged.last_norm().unwrap())[0].is_finite());
    flagged.forget_skipped_step();
    assert_eq!(flagged.steps(), 1, "{name}");
    let g = grads(&w, &data.grads[1], dtype, device);
    let w = flagged.step_unless(LR, w, g, flag(false));
    assert_eq!(read(&w), expected, "{name} {dtype:?}: after a skipped step");
}

backend_test! {
    fn fused_adamw_follows_the_reference_and_burns_adamw<B>(device, name, dtypes) {
        let mut rng = Rng::fresh();
        let fused = format!("{name}, fused");
        f32_steps::<Autodiff<Bastile<B>>>(&fused, device, &mut rng);
        if checks_composite(name) {
            f32_steps::<Autodiff<B>>(&format!("{name}, composite"), device, &mut rng);
        }
        for &dtype in dtypes.iter().filter(|&&d| d != DType::F32) {
            master_follows_f32::<Autodiff<Bastile<B>>>(&fused, dtype, device, &mut rng);
        }
        for &dtype in dtypes {
            resumes::<Autodiff<Bastile<B>>>(&fused, dtype, device, &mut rng);
            skips_non_finite::<Autodiff<Bastile<B>>>(&fused, dtype, device, &mut rng);
            skips_on_flag::<Autodiff<Bastile<B>>>(&fused, dtype, device, &mut rng);
        }
    }
}

#[test]
fn adamw_on_the_cpu_follows_the_reference() {
    // Backends without the kernels run the composite step.
    let mut rng = Rng::fresh();
    let device = Default::default();
    f32_steps::<Autodiff<NdArray>>("ndarray", &device, &mut rng);
    resumes::<Autodiff<NdArray>>("ndarray", DType::F32, &device, &mut rng);
    skips_non_finite::<Autodiff<NdArray>>("ndarray", DType::F32, &device, &mut rng);
    skips_on_flag::<Autodiff<NdArray>>("ndarray", DType::F32, &device, &mut rng);
}

#[test]
fn bad_settings_are_errors() {
    type B = Autodiff<NdArray>;
    let bad = |cfg: AdamWConfig, needle: &str| {
        let Err(BastileError::Config(e)) = cfg.init::<B>().map(|_: AdamW<B>| ()) else {
            panic!("{needle}: not a configuration error");
        };
        assert!(e.contains(needle), "`{e}` does not say `{needle}`");
    };
    bad(AdamWConfig::new().with_betas(1.0, 0.999), "betas");
    bad(AdamWConfig::new().with_betas(0.9, -0.1), "betas");
    bad(AdamWConfig::new().with_epsilon(0.0), "epsilon");
    bad(AdamWConfig::new().with_weight_decay(-1.0), "weight decay");
    bad(
        AdamWConfig::new().with_max_grad_norm(Some(0.0)),
        "max_grad_norm",
    );
    bad(
        AdamWConfig::new().with_max_grad_norm(Some(f64::NAN)),
        "max_grad_norm",
    );
}
