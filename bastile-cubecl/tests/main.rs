//! The kernel tests, one module per op, linked into a single test binary so
//! CubeCL and the kernels are compiled once. Each runs on the runtimes
//! `BASTILE_TEST_RUNTIMES` selects (see `bastile_cubecl::testing`).

mod adamw;
mod attention;
mod buffers;
mod combine;
mod cross_entropy;
#[cfg(feature = "cuda")]
mod cuda_graph;
mod embedding;
mod expert_groups;
mod gather;
mod geglu;
mod reduce;
mod rms_norm;
mod rope;
mod swiglu;
