//! The yardstick: a plain device-to-device copy, 16 bytes per unit.

use cubecl::prelude::*;

#[cube(launch_unchecked)]
fn copy_kernel<N: Size>(
    input: &Tensor<Vector<f32, N>>,
    output: &mut Tensor<Vector<f32, N>>,
    len: usize,
) {
    let i = CUBE_POS * CUBE_DIM as usize + UNIT_POS as usize;
    if i < len {
        output[i] = input[i];
    }
}

/// Copy bandwidth in GB/s, counting bytes read plus bytes written.
pub fn measure_copy_bandwidth<R: Runtime>(device: &R::Device, tiny: bool, samples: usize) -> f64 {
    let client = R::client(device);
    let bytes: usize = if tiny { 16 << 20 } else { 1 << 30 };
    let vec = 4;
    let len = bytes / 4 / vec;
    let input = client.empty(bytes);
    let output = client.empty(bytes);
    let cube = 256usize;
    let count = bastile_cubecl::launch::cube_count(&client, len.div_ceil(cube)).expect("copy grid");
    let seconds = crate::timing::median_seconds(
        samples,
        if tiny { 2 } else { 10 },
        |_| unsafe {
            copy_kernel::launch_unchecked::<R>(
                &client,
                count.clone(),
                CubeDim::new_1d(cube as u32),
                vec,
                TensorArg::from_raw_parts(input.clone(), [1].into(), [len * vec].into()),
                TensorArg::from_raw_parts(output.clone(), [1].into(), [len * vec].into()),
                len,
            )
        },
        || {
            let _ = cubecl::future::block_on(client.sync());
        },
    );
    2.0 * bytes as f64 / seconds / 1e9
}
