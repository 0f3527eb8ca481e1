//! f64 reference RoPE (see [`crate::rope`]).

use crate::rope::RopePairing;

/// Rotates one head vector `x` (length `2·half`) with the table row
/// `(cos, sin)` (length `half`), products rounded through the dtype.
pub fn rotate(
    x: &[f64],
    cos: &[f64],
    sin: &[f64],
    pairing: RopePairing,
    inverse: bool,
    round: impl Fn(f64) -> f64,
) -> Vec<f64> {
    let half = x.len() / 2;
    let mut out = vec![0.0; x.len()];
    for i in 0..half {
        let (ia, ib) = match pairing {
            RopePairing::Half => (i, i + half),
            RopePairing::Interleaved => (2 * i, 2 * i + 1),
        };
        let c = round(cos[i]);
        let s = if inverse {
            -round(sin[i])
        } else {
            round(sin[i])
        };
        let (a, b) = (x[ia], x[ib]);
        out[ia] = round(a * c) - round(b * s);
        out[ib] = round(b * c) + round(a * s);
    }
    out
}
