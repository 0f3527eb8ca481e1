//! Drop-in replacements for `burn::nn` modules: same config fields, same
//! parameter names (so records and weight maps stay valid), fused ops inside.

mod cross_entropy;
mod linear_cross_entropy;
mod rms_norm;
mod rope_frequencies;
mod rotary_encoding;
mod swiglu;

pub use cross_entropy::{CrossEntropyLoss, CrossEntropyLossConfig, CrossEntropyLossRecord};
pub use linear_cross_entropy::{LinearCrossEntropyLoss, LinearCrossEntropyLossConfig};
pub use rms_norm::{RmsNorm, RmsNormConfig};
pub use rope_frequencies::{RopeScaling, rope_frequencies};
pub use rotary_encoding::{RotaryEncoding, RotaryEncodingConfig};
pub use swiglu::{SwiGlu, SwiGluConfig, SwiGluMlp, SwiGluMlpConfig, SwiGluMlpRecord, SwiGluRecord};
