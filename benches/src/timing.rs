//! Synchronize-then-clock timing: warm-up, then the median of many samples.

use std::time::Instant;

/// Median seconds per call of `op` over `samples` samples of `iters` calls;
/// `sync` waits for the device. `op` gets the call index, to rotate inputs.
/// What `op` returns is kept until the sample's closing sync, so a lazy
/// backend cannot skip work whose results nobody holds.
pub fn median_seconds<T>(
    samples: usize,
    iters: usize,
    mut op: impl FnMut(usize) -> T,
    sync: impl Fn(),
) -> f64 {
    // Warm-up: compilation and autotuning happen here, not in the samples.
    let warm: Vec<T> = (0..iters.max(3)).map(&mut op).collect();
    sync();
    drop(warm);
    let mut times: Vec<f64> = (0..samples.max(1))
        .map(|_| {
            sync();
            let start = Instant::now();
            let kept: Vec<T> = (0..iters).map(&mut op).collect();
            sync();
            let t = start.elapsed().as_secs_f64() / iters as f64;
            drop(kept);
            t
        })
        .collect();
    times.sort_by(|a, b| a.total_cmp(b));
    times[times.len() / 2]
}
