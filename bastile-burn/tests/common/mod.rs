//! Burn-level test support: the backends a run covers and tensor helpers.
//!
//! `BASTILE_TEST_RUNTIMES` (see `bastile_cubecl::testing`) selects wgpu
//! and/or CUDA; each runtime is tested both as a plain `CubeBackend` (direct
//! kernel launch) and behind `Fusion` (kernels as custom fusion ops).

#![allow(dead_code)]

use bastile::BastileBackend;
use bastile::ops::KernelBackend;
use bastile_cubecl::testing::{Rng, runtime_selected};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};

/// A test body generic over the inner backend `B` (Bastile<B> is tested
/// against `B`).
pub trait BackendTest {
    fn run<B>(&self, device: &B::Device, name: &str, dtypes: &[DType])
    where
        B: KernelBackend + BastileBackend;
}

/// A `#[test]` whose body runs on every selected backend (see
/// [`for_each_backend`]):
///
/// ```text
/// backend_test! {
///     /// What it checks.
///     fn rms_norm_matches_reference<B>(device, name, dtypes) { .. }
/// }
/// ```
///
/// The body sees the inner backend `B`, its `device`, the backend's `name`
/// for messages and the `dtypes` it runs.
macro_rules! backend_test {
    (
        $(#[$attr:meta])*
        fn $test:ident<$b:ident>($device:ident, $name:ident, $dtypes:ident) $body:block
    ) => {
        $(#[$attr])*
        #[test]
        fn $test() {
            struct Test;
            impl $crate::common::BackendTest for Test {
                fn run<$b>(
                    &self,
                    $device: &$b::Device,
                    $name: &str,
                    $dtypes: &[burn::tensor::DType],
                ) where
                    $b: bastile::ops::KernelBackend + bastile::BastileBackend,
                $body
            }
            $crate::common::for_each_backend(&Test);
        }
    };
}
pub(crate) use backend_test;

pub fn for_each_backend(test: &impl BackendTest) {
    let mut ran = 0;
    if runtime_selected("wgpu", cfg!(feature = "wgpu")) {
        #[cfg(feature = "wgpu")]
        {
            use burn_cubecl::CubeBackend;
            use cubecl::wgpu::WgpuRuntime;
            let dtypes = [DType::F32, DType::F16];
            let device = Default::default();
            test.run::<CubeBackend<WgpuRuntime, f32, i32, u32>>(&device, "wgpu (direct)", &dtypes);
            test.run::<burn::backend::Wgpu>(&device, "wgpu (fusion)", &dtypes);
            ran += 1;
        }
    }
    if runtime_selected("cuda", cfg!(feature = "cuda")) {
        #[cfg(feature = "cuda")]
        {
            use burn_cubecl::CubeBackend;
            use cubecl::cuda::CudaRuntime;
            let dtypes = [DType::F32, DType::F16, DType::BF16];
            let device = Default::default();
            test.run::<CubeBackend<CudaRuntime, f32, i32, u8>>(&device, "cuda (direct)", &dtypes);
            test.run::<burn::backend::Cuda>(&device, "cuda (fusion)", &dtypes);
            ran += 1;
        }
    }
    assert!(
        ran > 0,
        "no runtime selected: set BASTILE_TEST_RUNTIMES to wgpu and/or cuda"
    );
}

/// Whether a test on the backend `name` (as [`for_each_backend`] names
/// them, "cuda (fusion)") runs every combination and the large shapes; see
/// `bastile_cubecl::testing::thorough`.
pub fn thorough(name: &str) -> bool {
    bastile_cubecl::testing::thorough(name.split_whitespace().next().unwrap_or(name))
}

/// Whether a test on the backend `name` also runs the composite path (`B`
/// itself, the reference semantics) to compare: on every direct backend,
/// and behind Fusion only when [`thorough`]. Behind Fusion the composite is
/// the same Burn ops, each new shape compiling fused kernels of Burn's own,
/// which on the software Vulkan driver cost more than the checks of ours.
pub fn checks_composite(name: &str) -> bool {
    thorough(name) || !name.contains("fusion")
}

/// `bastile_cubecl::testing::takes_turn` on the backend `name`.
pub fn takes_turn(name: &str, case: usize, dtype: usize, dtypes: usize) -> bool {
    bastile_cubecl::testing::takes_turn(case, dtype, dtypes, thorough(name))
}

/// The kernel dtype matching a Burn float dtype.
pub fn kdtype(dtype: DType) -> bastile_cubecl::FloatDtype {
    bastile::fused::kernel_dtype(dtype).unwrap_or_else(|| panic!("no kernel dtype for {dtype:?}"))
}

/// Random normal values already rounded to `dtype`, so the f64 reference
/// sees exactly what the backend holds.
pub fn randn(rng: &mut Rng, n: usize, mean: f64, std: f64, dtype: DType) -> Vec<f64> {
    rng.normals(n, mean, std)
        .into_iter()
        .map(|v| bastile_cubecl::testing::round_to(kdtype(dtype), v))
        .collect()
}

/// A tensor of `dtype` holding `values` (exactly: they are representable).
pub fn tensor<B: Backend, const D: usize>(
    values: &[f64],
    shape: [usize; D],
    dtype: DType,
    device: &B::Device,
) -> Tensor<B, D> {
    let data: Vec<f32> = values.iter().map(|&v| v as f32).collect();
    Tensor::<B, D>::from_data(TensorData::new(data, shape), device).cast(dtype)
}

/// A tensor's values as f64.
pub fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f64> {
    t.cast(DType::F32)
        .into_data()
        .convert::<f64>()
        .to_vec::<f64>()
        .expect("f64 data")
}

/// Each element of `actual` within `tol` of `magnitude` (the sum of its
/// terms' magnitudes) of `expected`.
pub fn assert_within(
    what: &str,
    actual: &[f64],
    expected: &[f64],
    magnitude: &[f64],
    tol: f64,
    seed: u64,
) {
    assert_eq!(actual.len(), expected.len(), "{what}: element count");
    for (i, ((a, e), m)) in actual.iter().zip(expected).zip(magnitude).enumerate() {
        assert!(
            (a - e).abs() <= tol * m,
            "{what}: element {i} is {a}, expected {e} within {tol:.1e} of {m} (the sum of its terms' magnitudes); seed {seed}"
        );
    }
}
