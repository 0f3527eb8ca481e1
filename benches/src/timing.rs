//! Synchronize-then-clock timing: warm-up, then the median of many samples.

use std::time::Instant;

/// Median seconds per call of `op` over `samples` samples of `iters` calls;
/// `sync` waits for the device. `op` gets the call index, to rotate inputs.
pub fn median_seconds(
    samples: usize,
    iters: usize,
    mut op: impl FnMut(usize),
    sync: impl Fn(),
) -> f64 {
    // Warm-up: compilation and autotuning happen here, not in the samples.
    for i in 0..iters.max(3) {
        op(i);
    }
    sync();
    let mut times: Vec<f64> = (0..samples.max(1))
        .map(|_| {
            sync();
            let start = Instant::now();
            for i in 0..iters {
                op(i);
            }
            sync();
            start.elapsed().as_secs_f64() / iters as f64
        })
        .collect();
    times.sort_by(|a, b| a.total_cmp(b));
    times[times.len() / 2]
}
