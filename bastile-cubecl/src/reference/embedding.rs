//! The embedding lookup's backward pass: each token's output gradient
//! added into its id's row, token by token, each add rounded to the
//! gradient's dtype.

/// `grad` (`vocab × hidden`) after `grad[ids[t]] += dout[t]` for every
/// token in order; ids outside `0..vocab` add nothing.
pub fn add_rows(
    grad: &[f64],
    ids: &[i32],
    dout: &[f64],
    hidden: usize,
    round: impl Fn(f64) -> f64,
) -> Vec<f64> {
    let vocab = grad.len() / hidden.max(1);
    let mut out = grad.to_vec();
    for (t, &id) in ids.iter().enumerate() {
        if id < 0 || id as usize >= vocab {
            continue;
        }
        let row = &mut out[id as usize * hidden..][..hidden];
        for (g, d) in row.iter_mut().zip(&dout[t * hidden..][..hidden]) {
            *g = round(*g + d);
        }
    }
    out
}
