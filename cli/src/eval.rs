//! The evaluation set of `bastile finetune`: a data file tokenized like the
//! training data (`--eval-data`), or a seeded fraction held out of the
//! training examples (`--eval-fraction`), whose mean loss is reported every
//! `--eval-every` steps and at the end.

use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

use crate::CliError;
use crate::data::Example;

/// Splits `examples` into `(training, evaluation)`: `fraction` of them
/// (rounded up, at least one, never all) go to evaluation, picked by a
/// shuffle seeded with `seed`; both keep the data set's order.
pub fn hold_out(
    examples: Vec<Example>,
    fraction: f64,
    seed: u64,
) -> Result<(Vec<Example>, Vec<Example>), CliError> {
    if !(fraction > 0.0 && fraction < 1.0) {
        return Err(CliError::Usage(format!(
            "--eval-fraction must lie strictly between 0 and 1, got {fraction}"
        )));
    }
    let n = examples.len();
    let held = ((n as f64 * fraction).ceil() as usize).max(1);
    if held >= n {
        return Err(CliError::Usage(format!(
            "--eval-fraction {fraction} of {n} examples leaves none to train on"
        )));
    }
    let mut order: Vec<usize> = (0..n).collect();
    // Its own stream, so the split does not move the training order.
    order.shuffle(&mut StdRng::seed_from_u64(seed ^ 0x6576_616c));
    let mut is_eval = vec![false; n];
    for &i in &order[..held] {
        is_eval[i] = true;
    }
    let (eval, train): (Vec<_>, Vec<_>) = examples
        .into_iter()
        .zip(is_eval)
        .partition(|(_, eval)| *eval);
    Ok((
        train.into_iter().map(|(e, _)| e).collect(),
        eval.into_iter().map(|(e, _)| e).collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn examples(n: u32) -> Vec<Example> {
        (0..n)
            .map(|i| Example {
                ids: vec![i, i + 1],
                labels: vec![-100, i64::from(i) + 1],
            })
            .collect()
    }

    #[test]
    fn holding_out_splits_by_the_fraction_and_the_seed() {
        let (train, eval) = hold_out(examples(10), 0.25, 7).unwrap();
        assert_eq!((train.len(), eval.len()), (7, 3));
        let mut all: Vec<u32> = train.iter().chain(&eval).map(|e| e.ids[0]).collect();
        all.sort();
        assert_eq!(all, (0..10).collect::<Vec<_>>());
        // The same seed holds out the same examples; the order is kept.
        assert_eq!(hold_out(examples(10), 0.25, 7).unwrap().1, eval);
        assert!(eval.windows(2).all(|w| w[0].ids[0] < w[1].ids[0]));
        let picks = |seed| hold_out(examples(10), 0.25, seed).unwrap().1;
        assert!((0..8).any(|seed| picks(seed) != eval));
        assert_eq!(hold_out(examples(3), 0.01, 1).unwrap().1.len(), 1);
        for bad in [0.0, 1.0, -0.5, f64::NAN] {
            let e = hold_out(examples(10), bad, 1).unwrap_err().to_string();
            assert!(e.contains("strictly between 0 and 1"), "{e}");
        }
        let e = hold_out(examples(1), 0.5, 1).unwrap_err().to_string();
        assert!(e.contains("leaves none to train on"), "{e}");
    }
}
