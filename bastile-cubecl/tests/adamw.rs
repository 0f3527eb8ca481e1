//! The fused AdamW step and the global gradient norm against the f64
//! reference over several steps: every parameter dtype, moments in the
//! parameter's dtype or f32, f32 master weights, clipping active and not,
//! weight decay, odd lengths (one element, lengths no vector width
//! divides, gradients spread over many cubes), NaN-poisoned partials;
//! non-finite gradients leave every buffer as it was; bad problems are
//! errors.

use bastile_cubecl::adamw::{
    self, AdamWBuffers, AdamWProblem, AdamWStep, GradView, PARAMS_PER_LAUNCH, ParamUpdate,
};
use bastile_cubecl::reference::adamw::{ParamState, clip_scale, global_norm};
use bastile_cubecl::testing::*;
use bastile_cubecl::{FloatDtype, KernelError};
use cubecl::prelude::*;
use cubecl::server::Handle;

/// One configuration of the optimizer.
#[derive(Clone, Copy, Debug)]
struct Setup {
    moments_f32: bool,
    master: bool,
    max_norm: Option<f64>,
    weight_decay: f64,
}

const SETUPS: [Setup; 4] = [
    // Moments in the parameter's dtype, as torch.optim.AdamW keeps them.
    Setup {
        moments_f32: false,
        master: false,
        max_norm: None,
        weight_decay: 0.0,
    },
    // Clipping that never binds (the norm stays below the bound).
    Setup {
        moments_f32: false,
        master: false,
        max_norm: Some(1e6),
        weight_decay: 0.01,
    },
    // Mixed precision: f32 moments and master weights, clipping that binds.
    Setup {
        moments_f32: true,
        master: true,
        max_norm: Some(0.5),
        weight_decay: 0.1,
    },
    Setup {
        moments_f32: true,
        master: false,
        max_norm: Some(2.0),
        weight_decay: 0.0,
    },
];

fn hyper(step: u64, weight_decay: f64) -> AdamWStep {
    AdamWStep {
        learning_rate: 0.05,
        beta1: 0.9,
        beta2: 0.999,
        epsilon: 1e-8,
        weight_decay,
        step,
    }
}

/// One parameter on the device and in the reference.
struct Param {
    len: usize,
    buffers: AdamWBuffers,
    reference: ParamState,
}

/// `[scale, norm]` of every gradient, the partials in a NaN-poisoned
/// buffer so an unwritten one shows.
fn global_scale<R: Runtime>(
    client: &ComputeClient<R>,
    grads: &[(&Handle, usize)],
    dtype: FloatDtype,
    max_norm: Option<f64>,
) -> Handle {
    let views: Vec<GradView> = grads
        .iter()
        .map(|&(handle, len)| GradView { handle, len, dtype })
        .collect();
    let total = adamw::partials_len(client, views.iter().map(|v| v.len));
    let partials = poisoned(client, FloatDtype::F32, total);
    let out = poisoned(client, FloatDtype::F32, 2);
    adamw::global_norm(client, &views, &partials, max_norm, &out).unwrap();
    out
}

#[allow(clippy::too_many_arguments)]
fn check<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: FloatDtype,
    setup: Setup,
    lens: &[usize],
    steps: u64,
    rng: &mut Rng,
) {
    let seed = rng.seed();
    let moments = if setup.moments_f32 {
        FloatDtype::F32
    } else {
        dtype
    };
    let what = |x: &str, step: u64| {
        format!("{x} {dtype} {setup:?} lens {lens:?} step {step}, seed {seed}")
    };
    let mut params: Vec<Param> = lens
        .iter()
        .map(|&len| {
            let weights = rounded(rng, dtype, len, 1.0);
            let zeros = vec![0.0; len];
            Param {
                len,
                buffers: AdamWBuffers {
                    param: upload(client, dtype, &weights),
                    grad: upload(client, dtype, &zeros),
                    moment1: upload(client, moments, &zeros),
                    moment2: upload(client, moments, &zeros),
                    master: setup
                        .master
                        .then(|| upload(client, FloatDtype::F32, &weights)),
                },
                reference: ParamState::new(weights),
            }
        })
        .collect();
    let weights_dtype = if setup.master { FloatDtype::F32 } else { dtype };
    for step in 1..=steps {
        let h = hyper(step, setup.weight_decay);
        let grads: Vec<Vec<f64>> = params
            .iter()
            .map(|p| rounded(rng, dtype, p.len, 0.3))
            .collect();
        for (p, g) in params.iter_mut().zip(&grads) {
            p.buffers.grad = upload(client, dtype, g);
        }
        let norm = global_norm(&grads.iter().map(Vec::as_slice).collect::<Vec<_>>());
        let scale = clip_scale(norm, setup.max_norm);
        // The reference update takes the scale the device computed (itself
        // checked here): its f32 norm over millions of values is off by
        // up to ~1e-5 relative, which every moment would inherit.
        let mut device_scale = scale;
        let clip = setup.max_norm.map(|max| {
            let handles: Vec<(&Handle, usize)> =
                params.iter().map(|p| (&p.buffers.grad, p.len)).collect();
            let out = global_scale(client, &handles, dtype, Some(max));
            let got = download(client, FloatDtype::F32, out.clone());
            assert_close(
                &what("[scale, norm]", step),
                &got,
                &[scale, norm],
                1e-5,
                seed,
            );
            device_scale = got[0];
            out
        });
        let problem = |len| AdamWProblem {
            len,
            param: dtype,
            grad: dtype,
            moments,
            master: setup.master,
        };
        // The weights before the step, for the update's own check.
        let olds: Vec<Vec<f64>> = params
            .iter()
            .map(|p| match &p.buffers.master {
                Some(m) => download(client, FloatDtype::F32, m.clone()),
                None => download(client, dtype, p.buffers.param.clone()),
            })
            .collect();
        // Every parameter in one call, as a model's step runs.
        let updates: Vec<ParamUpdate> = params
            .iter()
            .map(|p| ParamUpdate {
                problem: problem(p.len),
                buffers: &p.buffers,
            })
            .collect();
        adamw::update(
            client,
            &h,
            clip.as_ref(),
            &adamw::factors_buffer(client, &h),
            &updates,
        )
        .unwrap();
        let (mut deltas, mut expected_deltas) = (Vec::new(), Vec::new());
        let (mut weights, mut expected_weights) = (Vec::new(), Vec::new());
        let (mut m1s, mut expected_m1s) = (Vec::new(), Vec::new());
        let (mut m2s, mut expected_m2s) = (Vec::new(), Vec::new());
        for ((p, g), old) in params.iter_mut().zip(&grads).zip(olds) {
            let before = p.reference.weights.clone();
            p.reference.step(
                g,
                device_scale,
                &h,
                |x| round_to(weights_dtype, x),
                |x| round_to(moments, x),
            );
            m1s.extend(download(client, moments, p.buffers.moment1.clone()));
            m2s.extend(download(client, moments, p.buffers.moment2.clone()));
            expected_m1s.extend(&p.reference.moment1);
            expected_m2s.extend(&p.reference.moment2);
            let param = download(client, dtype, p.buffers.param.clone());
            expected_weights.extend(p.reference.weights.iter().map(|&w| round_to(dtype, w)));
            if weights_dtype == FloatDtype::F32 {
                let new = match &p.buffers.master {
                    Some(m) => download(client, FloatDtype::F32, m.clone()),
                    None => param.clone(),
                };
                deltas.extend(new.iter().zip(&old).map(|(n, o)| n - o));
                expected_deltas.extend(p.reference.weights.iter().zip(&before).map(|(n, o)| n - o));
            }
            weights.extend(param);
        }
        // The weights of every parameter at once, for the reason the
        // moments below are: a one-element parameter's weight can come
        // close to zero, and its relative error is then that of the terms.
        assert_close(
            &what("param", step),
            &weights,
            &expected_weights,
            tolerance(dtype),
            seed,
        );
        // The moments of every parameter at once: the first moment of a
        // one-element parameter is a sum of gradients of either sign, and
        // where it cancels its own relative error is that of the terms, not
        // of the result (1.3e-5 of the result measured in f32).
        let tol = tolerance(moments);
        assert_close(&what("m", step), &m1s, &expected_m1s, tol, seed);
        assert_close(&what("v", step), &m2s, &expected_m2s, tol, seed);
        if weights_dtype == FloatDtype::F32 {
            // The update itself, which the stored weights dwarf: the
            // weights' change against the reference's, over every
            // parameter (the change of a single element can cancel to a
            // few roundings of its weight).
            assert_close(&what("update", step), &deltas, &expected_deltas, 2e-5, seed);
        }
    }
}

struct FollowsReference;

impl RuntimeTest for FollowsReference {
    fn run<R: Runtime>(&self, device: &R::Device, runtime: &str, dtypes: &[FloatDtype]) {
        let client = R::client(device);
        let mut rng = Rng::fresh();
        let mut lens = vec![1usize, 7, 1003, 70_001];
        if thorough(runtime) {
            lens.push(3_000_017);
        }
        for dtype in supported_dtypes(&client, dtypes) {
            for setup in SETUPS {
                check(&client, dtype, setup, &lens, 3, &mut rng);
            }
        }
    }
}

#[test]
fn adamw_follows_the_reference_over_steps() {
    for_each_runtime(&FollowsReference);
}

struct ManyParameters;

impl RuntimeTest for ManyParameters {
    fn run<R: Runtime>(&self, device: &R::Device, _runtime: &str, dtypes: &[FloatDtype]) {
        let client = R::client(device);
        let mut rng = Rng::fresh();
        // More parameters than one launch takes, lengths of every vector
        // width interleaved (so one step has launches of several widths,
        // each split in chunks).
        let lens: Vec<usize> = (0..PARAMS_PER_LAUNCH * 2 + 7)
            .map(|i| match i % 5 {
                0 => 64 * (i + 1),
                1 => 2 * i + 1,
                2 => 4 * i + 4,
                3 => 1030 + 4 * i,
                _ => 2 * i + 2,
            })
            .collect();
        for dtype in supported_dtypes(&client, dtypes) {
            check(&client, dtype, SETUPS[2], &lens, 2, &mut rng);
        }
    }
}

#[test]
fn many_parameters_follow_the_reference() {
    for_each_runtime(&ManyParameters);
}

struct NonFinite;

impl RuntimeTest for NonFinite {
    fn run<R: Runtime>(&self, device: &R::Device, _runtime: &str, dtypes: &[FloatDtype]) {
        let client = R::client(device);
        let mut rng = Rng::fresh();
        for dtype in supported_dtypes(&client, dtypes) {
            for (bad, max_norm) in [(f64::NAN, Some(1.0)), (f64::INFINITY, None)] {
                let len = 515;
                let weights = rounded(&mut rng, dtype, len, 1.0);
                let moment = rounded(&mut rng, dtype, len, 0.1);
                let mut grad = rounded(&mut rng, dtype, len, 0.1);
                // The other gradient of the step is finite: one bad tensor
                // anywhere skips the whole step.
                let other = rounded(&mut rng, dtype, 64, 0.1);
                grad[300] = bad;
                let grad = upload(&client, dtype, &grad);
                let other = upload(&client, dtype, &other);
                let clip = global_scale(&client, &[(&grad, len), (&other, 64)], dtype, max_norm);
                let norm = download(&client, FloatDtype::F32, clip.clone())[1];
                assert!(
                    !norm.is_finite(),
                    "{dtype}: norm {norm} with a {bad} gradient"
                );
                let buffers = AdamWBuffers {
                    param: upload(&client, dtype, &weights),
                    grad,
                    moment1: upload(&client, dtype, &moment),
                    moment2: upload(
                        &client,
                        dtype,
                        &moment.iter().map(|m| m * m).collect::<Vec<_>>(),
                    ),
                    master: Some(upload(&client, FloatDtype::F32, &weights)),
                };
                // Every buffer the update may write, as bytes.
                let snapshot = |b: &AdamWBuffers| -> Vec<Vec<u8>> {
                    [&b.param, &b.moment1, &b.moment2, b.master.as_ref().unwrap()]
                        .into_iter()
                        .map(|h| client.read_one(h.clone()).unwrap().to_vec())
                        .collect()
                };
                let before = snapshot(&buffers);
                let problem = AdamWProblem {
                    len,
                    param: dtype,
                    grad: dtype,
                    moments: dtype,
                    master: true,
                };
                let update = ParamUpdate {
                    problem,
                    buffers: &buffers,
                };
                adamw::update(
                    &client,
                    &hyper(4, 0.1),
                    Some(&clip),
                    &adamw::factors_buffer(&client, &hyper(4, 0.1)),
                    &[update],
                )
                .unwrap();
                let after = snapshot(&buffers);
                assert!(
                    before == after,
                    "{dtype}: a {bad} gradient changed the state"
                );
            }
        }
    }
}

#[test]
fn non_finite_gradients_leave_every_buffer_unchanged() {
    for_each_runtime(&NonFinite);
}

struct BadProblems;

impl RuntimeTest for BadProblems {
    fn run<R: Runtime>(&self, device: &R::Device, _runtime: &str, _dtypes: &[FloatDtype]) {
        let client = R::client(device);
        let f32s = |n: usize| upload(&client, FloatDtype::F32, &vec![0.0; n]);
        let buffers = AdamWBuffers {
            param: f32s(10),
            grad: f32s(10),
            moment1: f32s(10),
            moment2: f32s(10),
            master: None,
        };
        let problem = AdamWProblem {
            len: 10,
            param: FloatDtype::F32,
            grad: FloatDtype::F32,
            moments: FloatDtype::F32,
            master: false,
        };
        let ok = hyper(1, 0.0);
        let one = |problem: AdamWProblem, buffers: &AdamWBuffers, h: &AdamWStep| {
            let update = ParamUpdate { problem, buffers };
            adamw::update(
                &client,
                h,
                None,
                &adamw::factors_buffer(&client, h),
                &[update],
            )
        };
        one(problem, &buffers, &ok).unwrap();
        let expect = |r: Result<(), KernelError>, needle: &str| {
            let e = r.expect_err(needle).to_string();
            assert!(e.contains(needle), "`{e}` does not say `{needle}`");
        };
        let with = |f: &dyn Fn(&mut AdamWStep)| {
            let mut h = ok;
            f(&mut h);
            one(problem, &buffers, &h)
        };
        expect(with(&|h| h.step = 0), "steps count from 1");
        expect(with(&|h| h.beta1 = 1.0), "betas");
        expect(with(&|h| h.beta2 = f64::NAN), "betas");
        expect(with(&|h| h.epsilon = 0.0), "epsilon");
        expect(with(&|h| h.learning_rate = -1.0), "learning rate");
        expect(with(&|h| h.weight_decay = f64::INFINITY), "weight decay");
        let long = AdamWProblem { len: 11, ..problem };
        expect(one(long, &buffers, &ok), "parameter 0, the weights");
        let update = ParamUpdate {
            problem,
            buffers: &buffers,
        };
        expect(
            adamw::update(&client, &ok, None, &f32s(2), &[update]),
            "the step's factors",
        );
        let half_moments = AdamWBuffers {
            moment2: f32s(5),
            ..buffers.clone()
        };
        expect(one(problem, &half_moments, &ok), "the second moment");
        let master = AdamWProblem {
            master: true,
            ..problem
        };
        expect(one(master, &buffers, &ok), "none were given");
        let partials = f32s(1);
        expect(
            adamw::clip_scale(&client, &partials, 1, Some(0.0), &f32s(2)),
            "clipping bound",
        );
        expect(
            adamw::clip_scale(&client, &partials, 4, Some(1.0), &f32s(2)),
            "the norm partials",
        );
        let big = 1 << 20;
        let grad = f32s(big);
        let view = GradView {
            handle: &grad,
            len: big,
            dtype: FloatDtype::F32,
        };
        expect(
            adamw::global_norm(&client, &[view], &partials, None, &f32s(2)),
            "the norm partials",
        );
        let short = GradView {
            len: big + 1,
            ..view
        };
        expect(
            adamw::global_norm(&client, &[view, short], &partials, None, &f32s(2)),
            "gradient 1",
        );
    }
}

#[test]
fn bad_problems_are_errors() {
    for_each_runtime(&BadProblems);
}
