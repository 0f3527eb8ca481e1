//! f64 reference RMSNorm.

use crate::rms_norm::RmsNormCast;

/// Forward: `(y, rstd)` for `rows × hidden` row-major `x`.
pub fn forward(
    x: &[f64],
    gamma: &[f64],
    hidden: usize,
    eps: f64,
    cast: RmsNormCast,
    round: impl Fn(f64) -> f64,
) -> (Vec<f64>, Vec<f64>) {
    let rows = x.len() / hidden;
    let mut y = vec![0.0; x.len()];
    let mut rstd = vec![0.0; rows];
    for r in 0..rows {
        let row = &x[r * hidden..(r + 1) * hidden];
        let ms = row.iter().map(|v| v * v).sum::<f64>() / hidden as f64;
        let s = 1.0 / (ms + eps).sqrt();
        rstd[r] = s;
        for (j, v) in row.iter().enumerate() {
            let n = v * s;
            y[r * hidden + j] = match cast {
                RmsNormCast::Llama => gamma[j] * round(n),
                RmsNormCast::GptOss => gamma[j] * n,
            };
        }
    }
    (y, rstd)
}

/// Backward: `(dx, dgamma)` given the forward's `x`, `gamma` and the
/// output gradient `dy`. `rstd` is recomputed in f64.
pub fn backward(
    x: &[f64],
    gamma: &[f64],
    dy: &[f64],
    hidden: usize,
    eps: f64,
    cast: RmsNormCast,
    round: impl Fn(f64) -> f64,
) -> (Vec<f64>, Vec<f64>) {
    let rows = x.len() / hidden;
    let mut dx = vec![0.0; x.len()];
    let mut dgamma = vec![0.0; hidden];
    for r in 0..rows {
        let xr = &x[r * hidden..(r + 1) * hidden];
        let dyr = &dy[r * hidden..(r + 1) * hidden];
        let ms = xr.iter().map(|v| v * v).sum::<f64>() / hidden as f64;
        let s = 1.0 / (ms + eps).sqrt();
        let mean_dot = (0..hidden)
            .map(|j| dyr[j] * gamma[j] * xr[j] * s)
            .sum::<f64>()
            / hidden as f64;
        for j in 0..hidden {
            let n = xr[j] * s;
            dx[r * hidden + j] = s * (dyr[j] * gamma[j] - n * mean_dot);
            let n_used = match cast {
                RmsNormCast::Llama => round(n),
                RmsNormCast::GptOss => n,
            };
            dgamma[j] += dyr[j] * n_used;
        }
    }
    (dx, dgamma)
}
