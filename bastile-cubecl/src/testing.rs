//! Test support shared by the kernel tests and the Burn-level tests
//! (feature `testing`): runtime selection, random inputs, dtype rounding,
//! error metrics.
//!
//! The runtimes a test run covers come from `BASTILE_TEST_RUNTIMES`
//! (comma-separated, `wgpu` and/or `cuda`; default `wgpu`), so the same test
//! binaries run on the software Vulkan driver in CI and on a CUDA GPU.

use crate::FloatDtype;

/// The runtimes selected for this test run.
pub fn selected_runtimes() -> Vec<String> {
    std::env::var("BASTILE_TEST_RUNTIMES")
        .unwrap_or_else(|_| "wgpu".into())
        .split(',')
        .map(|s| s.trim().to_lowercase())
        .filter(|s| !s.is_empty())
        .collect()
}

/// Whether `name` is selected; panics if it is selected but this binary was
/// built without it, so a misconfigured run cannot pass by testing nothing.
pub fn runtime_selected(name: &str, compiled: bool) -> bool {
    let wanted = selected_runtimes().iter().any(|r| r == name);
    assert!(
        !wanted || compiled,
        "runtime `{name}` selected by BASTILE_TEST_RUNTIMES but this test binary was built without feature `{name}`"
    );
    wanted
}

/// Whether a test checks every launch candidate on every shape and the
/// large shapes: on CUDA always; on other runtimes (the software Vulkan
/// driver runs the kernels on a CPU) only with `BASTILE_TEST_THOROUGH=1`.
/// Otherwise tests spread the candidates over their cases, so each is still
/// checked, and keep every property (mask options, odd shapes, dtypes,
/// poisoned outputs, gradients) on shapes sized for a CPU.
pub fn thorough(runtime: &str) -> bool {
    runtime == "cuda" || std::env::var("BASTILE_TEST_THOROUGH").is_ok_and(|v| v == "1")
}

/// Whether case number `case` runs in `dtypes[dtype]`: every case in every
/// dtype when `thorough`, else the dtypes take turns over the cases (for
/// cases that compile kernels of their own), so each case and each dtype is
/// still checked.
pub fn takes_turn(case: usize, dtype: usize, dtypes: usize, thorough: bool) -> bool {
    thorough || case % dtypes.max(1) == dtype
}

/// The items of `list` that case `case` checks: all of them when
/// `thorough`, else those whose index is `case` modulo `every` (at least
/// one), so that cases taking turns share the list: over `every` cases
/// each item is checked once.
pub fn share<T>(list: &[T], case: usize, every: usize, thorough: bool) -> Vec<&T> {
    if thorough || every <= 1 {
        return list.iter().collect();
    }
    let mine: Vec<&T> = list
        .iter()
        .enumerate()
        .filter(|(i, _)| i % every == case % every)
        .map(|(_, item)| item)
        .collect();
    if mine.is_empty() && !list.is_empty() {
        vec![&list[case % list.len()]]
    } else {
        mine
    }
}

/// A small, fast, seedable generator (SplitMix64) so tests need no extra
/// dependencies; seeds come from the clock, printed on failure.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator seeded from the clock (fresh inputs every run).
    pub fn fresh() -> Self {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0x5eed);
        Self(seed)
    }

    /// A generator in the state a failure printed as its seed, to replay
    /// that check.
    pub fn from_seed(seed: u64) -> Self {
        Self(seed)
    }

    pub fn seed(&self) -> u64 {
        self.0
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E3779B97F4A7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// `items` in a uniformly random order (Fisher–Yates).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = ((self.uniform() * (i + 1) as f64) as usize).min(i);
            items.swap(i, j);
        }
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// `n` normal values scaled by `std` and shifted by `mean`.
    pub fn normals(&mut self, n: usize, mean: f64, std: f64) -> Vec<f64> {
        (0..n).map(|_| mean + std * self.normal()).collect()
    }
}

/// Rounds an f64 to the nearest value `dtype` can hold (round to nearest even).
pub fn round_to(dtype: FloatDtype, v: f64) -> f64 {
    match dtype {
        FloatDtype::F32 => v as f32 as f64,
        FloatDtype::F16 => half::f16::from_f64(v).to_f64(),
        FloatDtype::BF16 => half::bf16::from_f64(v).to_f64(),
    }
}

/// `n` normal values (mean 0) already rounded to `dtype`, so the f64
/// reference sees exactly what the kernel reads.
pub fn rounded(rng: &mut Rng, dtype: FloatDtype, n: usize, std: f64) -> Vec<f64> {
    rng.normals(n, 0.0, std)
        .into_iter()
        .map(|v| round_to(dtype, v))
        .collect()
}

/// Encodes f64 values as bytes of `dtype` (rounded).
pub fn to_bytes(dtype: FloatDtype, values: &[f64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * dtype.size());
    for &v in values {
        match dtype {
            FloatDtype::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
            FloatDtype::F16 => out.extend_from_slice(&half::f16::from_f64(v).to_le_bytes()),
            FloatDtype::BF16 => out.extend_from_slice(&half::bf16::from_f64(v).to_le_bytes()),
        }
    }
    out
}

/// Decodes bytes of `dtype` to f64.
pub fn from_bytes(dtype: FloatDtype, bytes: &[u8]) -> Vec<f64> {
    match dtype {
        FloatDtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
            .collect(),
        FloatDtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f64())
            .collect(),
        FloatDtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f64())
            .collect(),
    }
}

/// Relative error bound for results stored in `dtype` after f32 math: a few
/// units of the dtype's rounding plus f32 accumulation slack.
pub fn tolerance(dtype: FloatDtype) -> f64 {
    match dtype {
        FloatDtype::F32 => 1e-5,
        FloatDtype::F16 => 2e-3,
        FloatDtype::BF16 => 1.6e-2,
    }
}

/// `‖actual − expected‖ / ‖expected‖`; infinite when any value is NaN or
/// infinite, so an unwritten (NaN-poisoned) element can never pass.
pub fn rel_l2(actual: &[f64], expected: &[f64]) -> f64 {
    assert_eq!(actual.len(), expected.len(), "length mismatch");
    if actual.iter().chain(expected).any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    let num: f64 = actual
        .iter()
        .zip(expected)
        .map(|(a, e)| (a - e) * (a - e))
        .sum();
    let den: f64 = expected.iter().map(|e| e * e).sum();
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

/// The largest element-wise error relative to the tensor's RMS, which
/// catches a single wrong element that the L2 norm would dilute.
pub fn max_rel_to_rms(actual: &[f64], expected: &[f64]) -> f64 {
    assert_eq!(actual.len(), expected.len(), "length mismatch");
    if actual.iter().chain(expected).any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    let rms = (expected.iter().map(|e| e * e).sum::<f64>() / expected.len().max(1) as f64).sqrt();
    actual
        .iter()
        .zip(expected)
        .map(|(a, e)| (a - e).abs())
        .fold(0.0, f64::max)
        / rms.max(f64::MIN_POSITIVE)
}

/// Asserts both error metrics are within `tol` (the element-wise one gets
/// a wider margin: one element may round the other way).
pub fn assert_close(what: &str, actual: &[f64], expected: &[f64], tol: f64, seed: u64) {
    let l2 = rel_l2(actual, expected);
    let max = max_rel_to_rms(actual, expected);
    assert!(
        l2 <= tol && max <= tol * 16.0,
        "{what}: relative L2 error {l2:.3e} (bound {tol:.1e}), max element error / rms {max:.3e} (bound {:.1e}); seed {seed}",
        tol * 16.0
    );
}

/// For values that cancel (sums of terms far larger than themselves): the
/// error `actual − expected` measured as [`assert_close`] measures it, but
/// against `size` (each element's terms' size) instead of `expected`.
pub fn assert_close_to_size(
    what: &str,
    actual: &[f64],
    expected: &[f64],
    size: &[f64],
    tol: f64,
    seed: u64,
) {
    assert_eq!(actual.len(), size.len(), "length mismatch");
    // Both sides shifted by `size`: their difference stays the error.
    let shifted: Vec<f64> = actual
        .iter()
        .zip(expected)
        .zip(size)
        .map(|((a, e), s)| s + (a - e))
        .collect();
    assert_close(what, &shifted, size, tol, seed);
}

/// For peaked values (a cross-entropy gradient: one probability near 1, the
/// rest near 0): the relative L2 error within `tol`, and each element
/// within `tol` of its own magnitude plus the RMS, rather than of the RMS
/// alone, which the few large elements dominate.
pub fn assert_close_to_magnitude(what: &str, actual: &[f64], expected: &[f64], tol: f64) {
    let l2 = rel_l2(actual, expected);
    assert!(
        l2 <= tol,
        "{what}: relative L2 error {l2:.3e} (bound {tol:.1e})"
    );
    let rms = (expected.iter().map(|e| e * e).sum::<f64>() / expected.len().max(1) as f64).sqrt();
    for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
        assert!(
            (a - e).abs() <= tol * (e.abs() + rms),
            "{what}: element {i} is {a}, expected {e} (bound {tol:.1e} × (|e| + rms {rms:.3e}))"
        );
    }
}

/// A test body generic over the CubeCL runtime.
pub trait RuntimeTest {
    /// Runs the test on `device` of runtime `R`, for each of `dtypes`.
    fn run<R: cubecl::Runtime>(&self, device: &R::Device, runtime: &str, dtypes: &[FloatDtype]);
}

/// The dtypes among `wanted` that the client can compute with.
pub fn supported_dtypes<R: cubecl::Runtime>(
    client: &cubecl::prelude::ComputeClient<R>,
    wanted: &[FloatDtype],
) -> Vec<FloatDtype> {
    wanted
        .iter()
        .copied()
        .filter(|d| client.properties().supports_type(d.storage()))
        .collect()
}

/// Runs `test` on every selected runtime: wgpu (f32, f16 where the device
/// has it; never bf16, which the software Vulkan driver lacks) and CUDA
/// (f32, f16, bf16).
// Without a runtime feature nothing runs (and the assert says why).
#[cfg_attr(
    not(any(feature = "wgpu", feature = "cuda")),
    allow(unused_variables, unused_mut)
)]
pub fn for_each_runtime(test: &impl RuntimeTest) {
    let mut ran = 0;
    if runtime_selected("wgpu", cfg!(feature = "wgpu")) {
        #[cfg(feature = "wgpu")]
        {
            test.run::<cubecl::wgpu::WgpuRuntime>(
                &Default::default(),
                "wgpu",
                &[FloatDtype::F32, FloatDtype::F16],
            );
            ran += 1;
        }
    }
    if runtime_selected("cuda", cfg!(feature = "cuda")) {
        #[cfg(feature = "cuda")]
        {
            test.run::<cubecl::cuda::CudaRuntime>(
                &Default::default(),
                "cuda",
                &[FloatDtype::F32, FloatDtype::F16, FloatDtype::BF16],
            );
            ran += 1;
        }
    }
    assert!(
        ran > 0,
        "no runtime selected: set BASTILE_TEST_RUNTIMES to wgpu and/or cuda"
    );
}

/// Uploads f64 values as `dtype`.
pub fn upload<R: cubecl::Runtime>(
    client: &cubecl::prelude::ComputeClient<R>,
    dtype: FloatDtype,
    values: &[f64],
) -> cubecl::server::Handle {
    client.create_from_slice(&to_bytes(dtype, values))
}

/// Uploads i32 values (labels, ids, lengths), what the kernels read as
/// integers.
pub fn upload_i32<R: cubecl::Runtime>(
    client: &cubecl::prelude::ComputeClient<R>,
    values: &[i32],
) -> cubecl::server::Handle {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    client.create_from_slice(&bytes)
}

/// Reads a buffer of i32 values back.
pub fn download_i32<R: cubecl::Runtime>(
    client: &cubecl::prelude::ComputeClient<R>,
    handle: cubecl::server::Handle,
) -> Vec<i32> {
    let bytes = client
        .read_one(handle)
        .expect("reading a device buffer back");
    bytes
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// A buffer of `len` elements of `dtype`, every one NaN, so an element the
/// kernel fails to write fails the comparison.
pub fn poisoned<R: cubecl::Runtime>(
    client: &cubecl::prelude::ComputeClient<R>,
    dtype: FloatDtype,
    len: usize,
) -> cubecl::server::Handle {
    upload(client, dtype, &vec![f64::NAN; len])
}

/// Reads a buffer of `dtype` back as f64.
pub fn download<R: cubecl::Runtime>(
    client: &cubecl::prelude::ComputeClient<R>,
    dtype: FloatDtype,
    handle: cubecl::server::Handle,
) -> Vec<f64> {
    let bytes = client
        .read_one(handle)
        .expect("reading a device buffer back");
    from_bytes(dtype, &bytes)
}

/// Head-major `[b, h, s, d]` values rearranged sequence-major
/// (`[b, s, h, d]`, what a projection's reshape holds before its heads are
/// swapped forward).
pub fn seq_major(values: &[f64], dims: [usize; 4]) -> Vec<f64> {
    let [b, h, s, d] = dims;
    let mut out = vec![0.0; values.len()];
    for bi in 0..b {
        for hi in 0..h {
            for si in 0..s {
                let from = ((bi * h + hi) * s + si) * d;
                let to = ((bi * s + si) * h + hi) * d;
                out[to..to + d].copy_from_slice(&values[from..from + d]);
            }
        }
    }
    out
}

/// Lays `rows × hidden` values out with rows `stride` elements apart, NaN
/// in the padding (a kernel that reads it fails).
pub fn pad_rows(values: &[f64], hidden: usize, stride: usize) -> Vec<f64> {
    let rows = values.len() / hidden;
    let mut out = vec![f64::NAN; rows * stride];
    for r in 0..rows {
        out[r * stride..r * stride + hidden].copy_from_slice(&values[r * hidden..(r + 1) * hidden]);
    }
    out
}

/// Reads a padded matrix back, asserting the padding is still NaN (a
/// kernel that writes it fails), and returns the dense values.
pub fn unpad_rows(padded: Vec<f64>, hidden: usize, stride: usize, what: &str) -> Vec<f64> {
    let rows = padded.len() / stride;
    let mut out = Vec::with_capacity(rows * hidden);
    for r in 0..rows {
        let row = &padded[r * stride..(r + 1) * stride];
        assert!(
            row[hidden..].iter().all(|v| v.is_nan()),
            "{what}: the kernel wrote into the row padding"
        );
        out.extend_from_slice(&row[..hidden]);
    }
    out
}
