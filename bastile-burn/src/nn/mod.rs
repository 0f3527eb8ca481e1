//! Drop-in replacements for `burn::nn` modules: same config fields, same
//! parameter names (so records and weight maps stay valid), fused ops inside.

mod rms_norm;
mod rope_frequencies;
mod rotary_encoding;
mod swiglu;

pub use rms_norm::{RmsNorm, RmsNormConfig};
pub use rope_frequencies::{RopeScaling, rope_frequencies};
pub use rotary_encoding::{RotaryEncoding, RotaryEncodingConfig};
pub use swiglu::{SwiGlu, SwiGluConfig, SwiGluMlp, SwiGluMlpConfig, SwiGluMlpRecord, SwiGluRecord};
