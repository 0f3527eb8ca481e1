//! Prints what the selected runtimes report: plane sizes, vector widths,
//! supported dtypes. Useful when a test skips a dtype.

use bastile_cubecl::testing::{RuntimeTest, for_each_runtime, supported_dtypes};
use bastile_cubecl::{FloatDtype, launch};
use cubecl::prelude::*;

struct Info;

impl RuntimeTest for Info {
    fn run<R: Runtime>(&self, device: &R::Device, runtime: &str, dtypes: &[FloatDtype]) {
        let client = R::client(device);
        let planes = launch::plane_sizes(&client);
        let hw = &client.properties().hardware;
        println!(
            "{runtime}: planes {}..{} (ops: {}), max units/cube {}, shared {} B, bindings {}, units {}, dtypes {:?}",
            planes.min,
            planes.max,
            planes.ops,
            hw.max_units_per_cube,
            hw.max_shared_memory_size,
            hw.max_bindings,
            launch::parallel_units(&client),
            supported_dtypes(&client, dtypes)
        );
    }
}

fn main() {
    for_each_runtime(&Info);
}
