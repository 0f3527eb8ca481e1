//! f64 reference cross-entropy (see [`crate::cross_entropy`] for the
//! semantics), row by row.

/// The options that change a row's loss and gradient.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Options {
    pub ignore_index: i64,
    pub label_smoothing: f64,
    pub z_loss: f64,
    pub softcap: Option<f64>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            ignore_index: -100,
            label_smoothing: 0.0,
            z_loss: 0.0,
            softcap: None,
        }
    }
}

/// One row's results: its loss, its log-sum-exp and the gradient of the
/// loss with respect to its (uncapped) logits, unscaled. Ignored rows have
/// loss 0 and gradient 0 (their `lse` is still computed).
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    pub loss: f64,
    pub lse: f64,
    pub grad: Vec<f64>,
}

/// Cross-entropy of one row of logits against `label`.
pub fn row(logits: &[f64], label: i64, options: &Options) -> Row {
    let vocab = logits.len();
    let z: Vec<f64> = match options.softcap {
        Some(c) => logits.iter().map(|x| c * (x / c).tanh()).collect(),
        None => logits.to_vec(),
    };
    let max = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let lse = max + z.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
    let active = label != options.ignore_index && label >= 0 && (label as usize) < vocab;
    if !active {
        return Row {
            loss: 0.0,
            lse,
            grad: vec![0.0; vocab],
        };
    }
    let eps = options.label_smoothing;
    let y = label as usize;
    let sum_z: f64 = z.iter().sum();
    let loss = lse - (1.0 - eps) * z[y] - eps / vocab as f64 * sum_z + options.z_loss * lse * lse;
    let grad = z
        .iter()
        .enumerate()
        .map(|(j, &zj)| {
            let p = (zj - lse).exp();
            let mut d = p * (1.0 + 2.0 * options.z_loss * lse) - eps / vocab as f64;
            if j == y {
                d -= 1.0 - eps;
            }
            match options.softcap {
                Some(c) => d * (1.0 - (zj / c) * (zj / c)),
                None => d,
            }
        })
        .collect();
    Row { loss, lse, grad }
}

/// [`row`] over every row of a `labels.len() × vocab` matrix.
pub fn rows(logits: &[f64], vocab: usize, labels: &[i64], options: &Options) -> Vec<Row> {
    logits
        .chunks(vocab)
        .zip(labels)
        .map(|(r, &y)| row(r, y, options))
        .collect()
}
