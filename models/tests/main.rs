//! The model tests, linked into a single test binary so Burn and the models
//! are compiled once.

mod common;

mod checkpointing;
mod hf_parity;
mod loading;
mod lora;
mod moe;
mod packing;
mod parallel;
mod precompile;
mod step_graphs;
mod training;
