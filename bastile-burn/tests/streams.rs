//! Several threads' fusion streams on one device: a kernel given the last
//! reference to a tensor created on another stream leaves it to the reads
//! other streams queued earlier and have not run yet (data-parallel workers
//! on one device share their parameters this way).

use std::sync::mpsc::channel;

use crate::common::*;
use bastile::ops::rms_norm::rms_norm;
use bastile::{Bastile, RmsNormCast};
use bastile_cubecl::reference::rms_norm as reference;
use bastile_cubecl::testing::{Rng, assert_close, round_to, tolerance};
use burn::tensor::DType;

backend_test! {
    fn a_tensor_consumed_on_one_stream_stays_readable_on_another<B>(device, name, _dtypes) {
        let mut rng = Rng::fresh();
        let seed = rng.seed();
        let dtype = DType::F32;
        let (rows, hidden, eps, cast) = (5, 64, 1e-6, RmsNormCast::Llama);
        let x = randn(&mut rng, rows * hidden, 0.1, 1.2, dtype);
        let gamma = randn(&mut rng, hidden, 1.0, 0.3, dtype);
        let round = |v| round_to(kdtype(dtype), v);
        let (expected, _) = reference::forward(&x, &gamma, hidden, eps, cast, round);

        // Created on this thread's stream.
        let xt = tensor::<Bastile<B>, 2>(&x, [rows, hidden], dtype, device);
        let gt = tensor::<Bastile<B>, 1>(&gamma, [hidden], dtype, device);
        let (x_reader, x_last) = (xt.clone(), xt);
        let (g_reader, g_last) = (gt.clone(), gt);
        let (recorded, wait_recorded) = channel();
        let (read, wait_read) = channel();
        let (first, second) = std::thread::scope(|s| {
            // Queues reads of `x` on its own stream, lets go of its reference
            // and runs them only once the other thread's kernel ran.
            let first = s.spawn(move || {
                // Element-wise ops wait in the stream for more to fuse with.
                let open = x_reader * g_reader.unsqueeze::<2>() + 1.0;
                recorded.send(()).unwrap();
                wait_read.recv().unwrap();
                values(open)
            });
            wait_recorded.recv().unwrap();
            // Holds the last references: its kernel is handed them.
            let second = s
                .spawn(move || values(rms_norm(x_last, g_last, eps, cast).unwrap()))
                .join()
                .unwrap();
            read.send(()).unwrap();
            (first.join().unwrap(), second)
        });
        let tol = tolerance(kdtype(dtype));
        let open: Vec<f64> = x
            .iter()
            .enumerate()
            .map(|(i, v)| v * gamma[i % hidden] + 1.0)
            .collect();
        assert_close(&format!("{name}: the element-wise ops"), &first, &open, tol, seed);
        assert_close(&format!("{name}: the last holder"), &second, &expected, tol, seed);
    }
}
