//! Drop-in replacements for `burn::nn` modules: same config fields, same
//! parameter names (so records and weight maps stay valid), fused ops inside.

mod rms_norm;

pub use rms_norm::{RmsNorm, RmsNormConfig};
