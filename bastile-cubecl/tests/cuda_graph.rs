//! A step graph on CUDA: a capture of many CubeCL launches (each with its
//! shape metadata uploaded from CubeCL's recycled staging memory) replays
//! with each launch's own shapes and the inputs copied into the captured
//! buffers, exactly as the launches ran plainly.

use bastile_cubecl::FloatDtype;
use bastile_cubecl::testing::*;
use cubecl::prelude::*;

/// Launches a capture records: more than CubeCL stages between two of its
/// fences (64), so the staging memory is recycled during the capture.
const LAUNCHES: usize = 150;
const LEN: usize = 1000;

/// `y[i] += x[i]` over the first `y.shape(0)` elements, read through the
/// strides: a launch that read another launch's metadata would add over
/// another range.
#[cube(launch_unchecked)]
fn add_prefix(x: &Tensor<f32>, y: &mut Tensor<f32>) {
    let i = ABSOLUTE_POS;
    if i < y.shape(0) {
        y[i * y.stride(0)] += x[i * x.stride(0)];
    }
}

/// Launch `k`'s length: it changes from launch to launch.
fn len_of(k: usize) -> usize {
    LEN - 37 * (k % 11)
}

/// Queues every launch of the step on `x` and `y`.
fn queue_step<R: Runtime>(
    client: &ComputeClient<R>,
    x: &cubecl::server::Handle,
    y: &cubecl::server::Handle,
) {
    for k in 0..LAUNCHES {
        let n = len_of(k);
        // SAFETY: both buffers hold LEN >= n f32 values, read contiguously.
        unsafe {
            add_prefix::launch_unchecked::<R>(
                client,
                CubeCount::Static(n.div_ceil(256) as u32, 1, 1),
                CubeDim::new_1d(256),
                TensorArg::from_raw_parts(x.clone(), [1].into(), [n].into()),
                TensorArg::from_raw_parts(y.clone(), [1].into(), [n].into()),
            )
        };
    }
}

/// `y` after one step from `y` with input `x`.
fn reference_step(x: &[f64], y: &mut [f64]) {
    for k in 0..LAUNCHES {
        for i in 0..len_of(k) {
            y[i] += x[i];
        }
    }
}

#[test]
fn a_replayed_step_graph_repeats_every_launch_with_its_own_shapes_and_new_inputs() {
    use bastile_cubecl::cuda_graph;
    use cubecl::cuda::{CudaDevice, CudaRuntime};

    if !runtime_selected("cuda", true) {
        return;
    }
    let device = CudaDevice { index: 0 };
    let client = CudaRuntime::client(&device);
    let f32 = FloatDtype::F32;
    // Small integers: every sum is exact in f32.
    let input = |seed: u64| -> Vec<f64> {
        let mut rng = Rng::from_seed(seed);
        (0..LEN).map(|_| (rng.uniform() * 8.0).floor()).collect()
    };
    let mut expected: Vec<f64> = (0..LEN).map(|i| (i % 5) as f64).collect();
    let x = upload(&client, f32, &input(1));
    let y = upload(&client, f32, &expected);

    // A plain step first: kernels compiled, pools grown.
    queue_step(&client, &x, &y);
    reference_step(&input(1), &mut expected);

    cuda_graph::begin(&client, 0).unwrap();
    queue_step(&client, &x, &y);
    let graph = cuda_graph::end(&client, 0).unwrap();
    assert_eq!(graph.kernels, LAUNCHES, "{graph:?}");
    // Nothing ran while capturing.
    assert_eq!(download(&client, f32, y.clone()), expected);

    for seed in 2..6 {
        let new = input(seed);
        let staged = upload(&client, f32, &new);
        cuda_graph::copy(
            &client,
            0,
            &staged.clone().binding(),
            &x.clone().binding(),
            LEN * 4,
        )
        .unwrap();
        graph.launch().unwrap();
        reference_step(&new, &mut expected);
        assert_eq!(
            download(&client, f32, y.clone()),
            expected,
            "replay with input {seed}"
        );
    }
    // A second capture while one is open is refused, and the first one
    // still closes into a graph.
    cuda_graph::begin(&client, 0).unwrap();
    let twice = cuda_graph::begin(&client, 0).unwrap_err();
    assert!(twice.to_string().contains("another"), "{twice}");
    queue_step(&client, &x, &y);
    let again = cuda_graph::end(&client, 0).unwrap();
    assert_eq!(again.kernels, LAUNCHES);
    drop((graph, again));
    // Nothing ran while capturing, and the stream runs plainly after.
    assert_eq!(download(&client, f32, y.clone()), expected);
    queue_step(&client, &x, &y);
    reference_step(&input(5), &mut expected);
    assert_eq!(download(&client, f32, y), expected);
}
