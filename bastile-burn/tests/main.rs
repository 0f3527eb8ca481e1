//! The Burn-level tests, one module per op or concern, linked into a single
//! test binary so Burn, CubeCL and the kernels are compiled once.

mod common;

mod adamw;
mod attention;
mod batched_linear;
mod checkpointing;
mod combine_rows;
mod cross_entropy;
mod drop_in;
mod embedding;
mod expert_groups;
mod gather_rows;
mod geglu;
mod lora;
mod matmul;
mod model_step;
mod patches;
mod reduce;
mod rms_norm;
mod rope;
mod router;
mod streams;
mod swiglu;
