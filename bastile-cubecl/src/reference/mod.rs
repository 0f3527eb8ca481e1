//! f64 CPU implementations of every op: the ground truth the kernels and the
//! composite Burn paths are tested against. Inputs are the values the
//! kernel sees (already rounded to its dtype); `round` maps an f64 to the
//! value the kernel's dtype can hold, for the spots where the semantics
//! round an intermediate (e.g. RMSNorm's Llama cast).

pub mod adamw;
pub mod attention;
pub mod cross_entropy;
pub mod embedding;
pub mod expert_groups;
pub mod geglu;
pub mod lora;
pub mod rms_norm;
pub mod rope;
pub mod router;
pub mod swiglu;
