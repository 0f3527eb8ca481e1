//! The data of the training benchmark's `--layout padded` and `--layout
//! packed`: an instruction data set of mixed lengths, batched one example
//! per row (padded to the batch's longest, as `bastile finetune
//! --no-packing` does) or packed whole into rows (as `bastile finetune`
//! does by default), through the command's own batching code.

use bastile_cli::batches::Batcher;
use bastile_cli::data::Example;
use bastile_models::MicroBatch;
use burn::tensor::backend::AutodiffBackend;
use clap::ValueEnum;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// What the training benchmark's steps train on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DataLayout {
    /// Random tokens filling every row.
    Full,
    /// The instruction data set, one example per row, padded to the
    /// batch's longest (rounded up to [`PAD_MULTIPLE`]).
    Padded,
    /// The same examples packed whole into rows of `--seq` tokens, each
    /// attending only to itself.
    Packed,
}

impl DataLayout {
    pub fn name(self) -> &'static str {
        match self {
            Self::Full => "full",
            Self::Padded => "padded",
            Self::Packed => "packed",
        }
    }
}

/// Padded batches are rounded up to a multiple of this many tokens (the
/// command's default on a GPU).
const PAD_MULTIPLE: usize = 64;

/// The data set's token counts: log-normal around 300 tokens (σ = 0.8 in
/// log space), cut to 50..=2000 and to `longest`; most examples a few
/// hundred tokens and a long tail, the shape of Alpaca-style instruction
/// sets. Seeded: the same on every run.
pub fn example_lengths(count: usize, longest: usize, seed: u64) -> Vec<usize> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..count)
        .map(|_| {
            // Box–Muller: one standard normal from two uniforms.
            let (u, v): (f64, f64) = (rng.random::<f64>().max(f64::MIN_POSITIVE), rng.random());
            let normal = (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos();
            let n = (300.0f64.ln() + 0.8 * normal).exp().round() as usize;
            n.clamp(50, 2000).min(longest)
        })
        .collect()
}

/// `count` micro-batches of `rows` rows in `layout` (not `Full`), each
/// with its trained (non-padding) tokens: random token ids below `vocab`,
/// every one a label.
pub fn micro_batches<B: AutodiffBackend>(
    layout: DataLayout,
    rows: usize,
    seq: usize,
    vocab: usize,
    count: usize,
    device: &B::Device,
) -> Vec<(MicroBatch<B>, usize)> {
    let mut rng = StdRng::seed_from_u64(7);
    let examples: Vec<Example> = example_lengths(4096, seq, 11)
        .into_iter()
        .map(|n| {
            let ids: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab as u32)).collect();
            let labels = ids.iter().map(|&i| i64::from(i)).collect();
            Example { ids, labels }
        })
        .collect();
    let batcher = Batcher {
        packing: layout == DataLayout::Packed,
        rows,
        row_len: seq,
        pad_id: 0,
        multiple: PAD_MULTIPLE,
    };
    let mut order = (0..examples.len()).cycle().peekable();
    (0..count)
        .map(|_| {
            let (batch, _) = batcher
                .next(&mut order, &examples)
                .expect("the order cycles");
            let tokens = batch.tokens;
            (batch.to_device(device), tokens)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::example_lengths;

    #[test]
    fn lengths_spread_like_an_instruction_set() {
        let lengths = example_lengths(4096, 2048, 11);
        let mut sorted = lengths.clone();
        sorted.sort_unstable();
        let median = sorted[sorted.len() / 2];
        assert!((250..350).contains(&median), "median {median}");
        assert!(*sorted.first().unwrap() == 50 && *sorted.last().unwrap() == 2000);
        let long = sorted.iter().filter(|&&n| n > 1000).count();
        assert!(
            (80..400).contains(&long),
            "{long} examples over 1000 tokens"
        );
        assert_eq!(lengths, example_lengths(4096, 2048, 11));
    }
}
