//! Bastile's fused training kernels, written once in CubeCL.
//!
//! Every op lives in one file (`rms_norm.rs`, ...) holding its `#[cube]` kernels,
//! the host-side launchers and its autotune set. The crate depends on CubeCL
//! only: it speaks in buffers ([`cubecl::server::Handle`]), shapes and dtypes,
//! so any CubeCL runtime (CUDA, wgpu/Vulkan, ...) can run it and the Burn
//! integration lives one layer up, in the `bastile` crate.

pub mod adamw;
pub mod attention;
pub mod combine;
pub mod cross_entropy;
#[cfg(feature = "cuda")]
pub mod cublaslt;
#[cfg(feature = "cuda")]
pub mod cuda_graph;
#[cfg(feature = "cuda")]
mod cuda_stream;
#[cfg(feature = "cuda")]
pub mod cudnn;
pub mod dtype;
pub mod elementwise;
pub mod embedding;
pub mod error;
pub mod expert_groups;
pub mod gather;
pub mod geglu;
pub mod gemm_layout;
pub mod glu;
pub mod launch;
pub mod reduce;
pub mod reference;
pub mod rms_norm;
pub mod rope;
pub mod router;
pub mod rows;
pub mod swiglu;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod tune;

pub use dtype::FloatDtype;
pub use error::KernelError;
