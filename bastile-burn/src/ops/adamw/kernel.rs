//! The fused AdamW step on `CubeBackend`: the gradients' global norm into
//! one small buffer, then every parameter updated in place, many a launch.

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;

use bastile_cubecl::FloatDtype;
use bastile_cubecl::adamw::{self, AdamWBuffers, AdamWProblem, AdamWStep, GradView, ParamUpdate};

use super::AdamWTensors;
use crate::fused::cube::empty_like;
use crate::fused::{kernel, kernel_dtype};
use crate::launch_failure::{launch, launch_failed};

/// The gradient norm: inputs the gradients, output `[scale, norm]`.
#[derive(Clone, Copy, Debug)]
pub(super) struct ClipLaunch {
    pub max_norm: Option<f64>,
}

kernel!(ClipLaunch, "bastile_adamw_clip", |op, grads, _| {
    vec![clip(grads, op.max_norm)]
});

/// The update: inputs every state (`sizes[i]` tensors each, see
/// [`AdamWTensors::into_vec`]), every gradient, the clip factor when
/// `clipped`, then the step's factors ([`AdamWStep::factors`]); outputs the
/// states.
#[derive(Clone, Debug)]
pub(super) struct UpdateLaunch {
    pub hyper: AdamWStep,
    pub sizes: Vec<usize>,
    pub clipped: bool,
}

kernel!(UpdateLaunch, "bastile_adamw_update", |op, mut inputs, _| {
    let factors = inputs.pop().expect("the step's factors");
    let clip = op.clipped.then(|| inputs.pop().expect("the clip factor"));
    let states_len = op.sizes.iter().sum();
    let grads = inputs.split_off(states_len);
    let states = AdamWTensors::split(inputs, &op.sizes);
    update(states, grads, clip, factors, op.hyper)
        .into_iter()
        .flat_map(AdamWTensors::into_vec)
        .collect()
});

fn dtype_of<R: CubeRuntime>(t: &CubeTensor<R>) -> FloatDtype {
    kernel_dtype(t.dtype).expect("a dtype the support check took")
}

/// `t` contiguous and held by nobody else, so the update may write it in
/// place: the optimizer normally holds the only reference, and a copy is
/// made only when it does not.
fn writable<R: CubeRuntime>(t: CubeTensor<R>) -> CubeTensor<R> {
    let t = into_contiguous(t);
    if t.can_mut() { t } else { t.copy() }
}

fn clip<R: CubeRuntime>(grads: Vec<CubeTensor<R>>, max_norm: Option<f64>) -> CubeTensor<R> {
    let grads: Vec<CubeTensor<R>> = grads.into_iter().map(into_contiguous).collect();
    let views: Vec<GradView> = grads
        .iter()
        .map(|g| GradView {
            handle: &g.handle,
            len: g.shape().num_elements(),
            dtype: dtype_of(g),
        })
        .collect();
    let first = &grads[0];
    let total = adamw::partials_len(&first.client, views.iter().map(|v| v.len));
    let partials = empty_like(first, Shape::new([total]), DType::F32);
    let out = empty_like(first, Shape::new([2]), DType::F32);
    launch("gradient norm", || {
        adamw::global_norm(
            &first.client,
            &views,
            &partials.handle,
            max_norm,
            &out.handle,
        )
    });
    out
}

fn update<R: CubeRuntime>(
    params: Vec<AdamWTensors<CubeTensor<R>>>,
    grads: Vec<CubeTensor<R>>,
    clip: Option<CubeTensor<R>>,
    factors: CubeTensor<R>,
    hyper: AdamWStep,
) -> Vec<AdamWTensors<CubeTensor<R>>> {
    let Some(client) = params.first().map(|p| p.param.client.clone()) else {
        return Vec::new();
    };
    let params: Vec<AdamWTensors<CubeTensor<R>>> = params
        .into_iter()
        .map(|state| AdamWTensors {
            param: writable(state.param),
            moment1: writable(state.moment1),
            moment2: writable(state.moment2),
            master: state.master.map(writable),
        })
        .collect();
    let grads: Vec<CubeTensor<R>> = grads.into_iter().map(into_contiguous).collect();
    let clip = clip.map(into_contiguous);
    let factors = into_contiguous(factors);
    let buffers: Vec<(AdamWProblem, AdamWBuffers)> = params
        .iter()
        .zip(&grads)
        .map(|(state, grad)| {
            let problem = AdamWProblem {
                len: state.param.shape().num_elements(),
                param: dtype_of(&state.param),
                grad: dtype_of(grad),
                moments: dtype_of(&state.moment1),
                master: state.master.is_some(),
            };
            let buffers = AdamWBuffers {
                param: state.param.handle.clone(),
                grad: grad.handle.clone(),
                moment1: state.moment1.handle.clone(),
                moment2: state.moment2.handle.clone(),
                master: state.master.as_ref().map(|m| m.handle.clone()),
            };
            (problem, buffers)
        })
        .collect();
    let updates: Vec<ParamUpdate> = buffers
        .iter()
        .map(|(problem, buffers)| ParamUpdate {
            problem: *problem,
            buffers,
        })
        .collect();
    // After a failed launch in this step the gradients (and the clip
    // factor) hold nothing meaningful: write no parameter.
    if !launch_failed() {
        launch("AdamW update", || {
            adamw::update(
                &client,
                &hyper,
                clip.as_ref().map(|c| &c.handle),
                &factors.handle,
                &updates,
            )
        });
    }
    params
}
