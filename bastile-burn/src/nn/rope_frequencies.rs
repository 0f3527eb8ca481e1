//! RoPE inverse frequencies and attention scaling, computed exactly as HF
//! transformers' `ROPE_INIT_FUNCTIONS` do (in f32): the default schedule,
//! Llama 3's `"llama3"` scaling and YaRN (GPT-OSS).

use crate::BastileError;

/// A rope scaling scheme, with HF's parameter names.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum RopeScaling {
    /// `inv_freq[i] = theta^(−2i/d)`.
    None,
    /// Llama 3.x: low frequencies divided by `factor`, high ones kept, a
    /// smooth ramp between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
    /// YaRN (GPT-OSS: factor 32, beta_fast 32, beta_slow 1, original 4096,
    /// truncate false); `attention_factor` defaults to `0.1·ln(factor) + 1`.
    Yarn {
        factor: f64,
        beta_fast: f64,
        beta_slow: f64,
        original_max_position_embeddings: usize,
        truncate: bool,
        attention_factor: Option<f64>,
        mscale: Option<f64>,
        mscale_all_dim: Option<f64>,
    },
}

/// HF's `arange(0, dim, 2) / dim` exponents and `base ** exponent`, in f32.
fn pos_freqs(head_dim: usize, theta: f64) -> Vec<f32> {
    (0..head_dim / 2)
        .map(|i| (theta as f32).powf((2 * i) as f32 / head_dim as f32))
        .collect()
}

/// `(inv_freq, attention_scaling)` for a head of `head_dim` elements.
///
/// Errors on an odd head_dim, a non-positive theta or invalid scaling
/// parameters.
pub fn rope_frequencies(
    head_dim: usize,
    theta: f64,
    scaling: &RopeScaling,
) -> Result<(Vec<f32>, f32), BastileError> {
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(BastileError::Config(format!(
            "RoPE needs an even, positive head_dim, got {head_dim}"
        )));
    }
    if !(theta.is_finite() && theta > 0.0) {
        return Err(BastileError::Config(format!(
            "RoPE theta must be positive and finite, got {theta}"
        )));
    }
    let base = pos_freqs(head_dim, theta);
    match *scaling {
        RopeScaling::None => Ok((base.iter().map(|p| 1.0 / p).collect(), 1.0)),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            if !(factor > 0.0 && high_freq_factor > low_freq_factor && low_freq_factor > 0.0) {
                return Err(BastileError::Config(format!(
                    "llama3 rope scaling needs factor > 0 and high_freq_factor > low_freq_factor > 0, got {scaling:?}"
                )));
            }
            let old = original_max_position_embeddings as f32;
            let (factor, low, high) = (
                factor as f32,
                low_freq_factor as f32,
                high_freq_factor as f32,
            );
            let low_wavelen = old / low;
            let high_wavelen = old / high;
            let inv = base
                .iter()
                .map(|p| {
                    let f = 1.0 / p;
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    let scaled = if wavelen > low_wavelen { f / factor } else { f };
                    let smooth = (old / wavelen - low) / (high - low);
                    let smoothed = (1.0 - smooth) * scaled / factor + smooth * scaled;
                    // HF: `~(wavelen < high) * ~(wavelen > low)`.
                    let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                    if medium { smoothed } else { scaled }
                })
                .collect();
            Ok((inv, 1.0))
        }
        RopeScaling::Yarn {
            factor,
            beta_fast,
            beta_slow,
            original_max_position_embeddings,
            truncate,
            attention_factor,
            mscale,
            mscale_all_dim,
        } => {
            if !(factor > 0.0 && beta_fast > 0.0 && beta_slow > 0.0) {
                return Err(BastileError::Config(format!(
                    "YaRN rope scaling needs positive factor and betas, got {scaling:?}"
                )));
            }
            let get_mscale = |scale: f64, m: f64| {
                if scale <= 1.0 {
                    1.0
                } else {
                    0.1 * m * scale.ln() + 1.0
                }
            };
            let attention = match (attention_factor, mscale, mscale_all_dim) {
                (Some(a), _, _) => a,
                (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                    get_mscale(factor, m) / get_mscale(factor, all)
                }
                _ => get_mscale(factor, 1.0),
            };
            let dim = head_dim as f64;
            let orig = original_max_position_embeddings as f64;
            let correction_dim = |rotations: f64| {
                dim * (orig / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln())
            };
            let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
            if truncate {
                low = low.floor();
                high = high.ceil();
            }
            let low = low.max(0.0);
            let high = high.min(dim - 1.0);
            let span = if low == high { 0.001 } else { high - low };
            let factor32 = factor as f32;
            let inv = base
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let ramp = ((i as f32 - low as f32) / span as f32).clamp(0.0, 1.0);
                    let extrapolation_factor = 1.0 - ramp;
                    let extrapolation = 1.0 / p;
                    let interpolation = 1.0 / (factor32 * p);
                    interpolation * (1.0 - extrapolation_factor)
                        + extrapolation * extrapolation_factor
                })
                .collect();
            Ok((inv, attention as f32))
        }
    }
}
