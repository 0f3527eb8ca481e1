//! Examples into micro-batches, reshuffled every epoch: packed (several
//! examples per row, each its own document) or one example per row,
//! padded.

use std::iter::Peekable;

use bastile_models::MicroBatch;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, TensorData};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

use crate::chat::IGNORE;
use crate::data::Example;

/// Draws examples in a seeded random order, a new order each epoch.
pub struct Sampler {
    order: Vec<usize>,
    next: usize,
    rng: StdRng,
}

impl Sampler {
    pub fn new(examples: usize, seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut order: Vec<usize> = (0..examples).collect();
        order.shuffle(&mut rng);
        Self {
            order,
            next: 0,
            rng,
        }
    }

    /// Passes over the next `n` examples: the position of a run that has
    /// drawn `n` so far, whose order the same seed repeats.
    pub fn pass_over(&mut self, n: usize) {
        for _ in 0..n {
            self.advance();
        }
    }

    /// The index of the next example.
    fn advance(&mut self) -> usize {
        if self.next == self.order.len() {
            self.order.shuffle(&mut self.rng);
            self.next = 0;
        }
        self.next += 1;
        self.order[self.next - 1]
    }
}

/// The examples' indices, in the sampler's order, without end.
impl Iterator for Sampler {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        Some(self.advance())
    }
}

/// A micro-batch on the host: ids and labels `[batch, seq]` row-major,
/// padded on the right (pad ids, ignored labels), and for packed rows each
/// token's place in its example.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Padded {
    pub ids: Vec<i64>,
    pub labels: Vec<i64>,
    /// `[batch, seq]`, 0 where an example (or the padding) starts; `None`
    /// for one example per row.
    pub positions: Option<Vec<i64>>,
    pub shape: [usize; 2],
    /// Tokens that are not padding.
    pub tokens: usize,
}

impl Padded {
    /// The batch as tensors on `device`.
    pub fn to_device<B: AutodiffBackend>(self, device: &B::Device) -> MicroBatch<B> {
        let ints = |values: Vec<i64>| {
            Tensor::<B, 2, Int>::from_data(TensorData::new(values, self.shape), device)
        };
        MicroBatch {
            ids: ints(self.ids),
            labels: ints(self.labels),
            positions: self.positions.map(ints),
        }
    }
}

/// How examples become micro-batches.
#[derive(Clone, Copy, Debug)]
pub struct Batcher {
    /// Pack whole examples into rows (else one example per row).
    pub packing: bool,
    /// Rows per micro-batch.
    pub rows: usize,
    /// The tokens a packed row holds.
    pub row_len: usize,
    pub pad_id: u32,
    /// Rows are padded to a multiple of this length.
    pub multiple: usize,
}

impl Batcher {
    /// The micro-batch of the examples `order` yields next, and how many it
    /// took; `None` once `order` is spent.
    pub fn next<I: Iterator<Item = usize>>(
        &self,
        order: &mut Peekable<I>,
        examples: &[Example],
    ) -> Option<(Padded, usize)> {
        if self.packing {
            let length = |i: usize| examples[i].ids.len();
            let rows: Vec<Vec<&Example>> = pack_rows(order, length, self.rows, self.row_len)
                .into_iter()
                .map(|row| row.into_iter().map(|i| &examples[i]).collect())
                .collect();
            let count = rows.iter().map(Vec::len).sum();
            (count > 0).then(|| (pack(&rows, self.pad_id, self.multiple), count))
        } else {
            let picked: Vec<&Example> = order
                .by_ref()
                .take(self.rows)
                .map(|i| &examples[i])
                .collect();
            let count = picked.len();
            (count > 0).then(|| (pad(&picked, self.pad_id, self.multiple), count))
        }
    }
}

/// Up to `rows` rows of at most `row_len` tokens, filled in `order` with
/// whole examples (`length` gives each one's tokens): an example that
/// does not fit the current row starts the next, and one that fits no row
/// left stays first in `order` for the next call. Every example must fit
/// a row on its own.
pub fn pack_rows<I: Iterator<Item = usize>>(
    order: &mut Peekable<I>,
    length: impl Fn(usize) -> usize,
    rows: usize,
    row_len: usize,
) -> Vec<Vec<usize>> {
    let mut packed: Vec<Vec<usize>> = Vec::new();
    let mut row = Vec::new();
    let mut used = 0;
    while let Some(&next) = order.peek() {
        let n = length(next);
        assert!(
            n <= row_len,
            "an example of {n} tokens is longer than a row"
        );
        if used + n > row_len {
            packed.push(std::mem::take(&mut row));
            used = 0;
            if packed.len() == rows {
                return packed;
            }
        }
        row.push(next);
        used += n;
        order.next();
    }
    if !row.is_empty() {
        packed.push(row);
    }
    packed
}

/// Rows that each hold the examples of one entry of `rows`, one after the
/// other, padded on the right to the longest row rounded up to a multiple
/// of `multiple`. Each example is a document of its own: its positions
/// restart at 0 and its first label is ignored (no example is trained to
/// predict the next one's first token); the padding is one more.
pub fn pack(rows: &[Vec<&Example>], pad_id: u32, multiple: usize) -> Padded {
    let row_len = |r: &Vec<&Example>| r.iter().map(|e| e.ids.len()).sum::<usize>();
    let longest = rows.iter().map(row_len).max().unwrap_or(0);
    let seq = longest.next_multiple_of(multiple.max(1));
    let cells = rows.len() * seq;
    let (mut ids, mut labels, mut positions) = (
        Vec::with_capacity(cells),
        Vec::with_capacity(cells),
        Vec::with_capacity(cells),
    );
    let mut tokens = 0;
    for row in rows {
        for e in row {
            let n = e.ids.len();
            tokens += n;
            ids.extend(e.ids.iter().map(|&i| i64::from(i)));
            labels.push(IGNORE);
            labels.extend_from_slice(&e.labels[1..]);
            positions.extend(0..n as i64);
        }
        let fill = seq - row_len(row);
        ids.extend(std::iter::repeat_n(i64::from(pad_id), fill));
        labels.extend(std::iter::repeat_n(IGNORE, fill));
        positions.extend(0..fill as i64);
    }
    Padded {
        ids,
        labels,
        positions: Some(positions),
        shape: [rows.len(), seq],
        tokens,
    }
}

/// How many rows of `row_len` tokens packing examples of `lengths` in
/// this order fills: the packed counterpart of the number of examples.
pub fn packed_rows(lengths: &[usize], row_len: usize) -> usize {
    let mut order = (0..lengths.len()).peekable();
    pack_rows(&mut order, |i| lengths[i], usize::MAX, row_len).len()
}

/// Pads `examples` to their longest length rounded up to a multiple of
/// `multiple`.
pub fn pad(examples: &[&Example], pad_id: u32, multiple: usize) -> Padded {
    let longest = examples.iter().map(|e| e.ids.len()).max().unwrap_or(0);
    let seq = longest.next_multiple_of(multiple.max(1));
    let mut ids = Vec::with_capacity(examples.len() * seq);
    let mut labels = Vec::with_capacity(examples.len() * seq);
    let mut tokens = 0;
    for e in examples {
        let fill = seq - e.ids.len();
        tokens += e.ids.len();
        ids.extend(e.ids.iter().map(|&i| i64::from(i)));
        ids.extend(std::iter::repeat_n(i64::from(pad_id), fill));
        labels.extend_from_slice(&e.labels);
        labels.extend(std::iter::repeat_n(IGNORE, fill));
    }
    Padded {
        ids,
        labels,
        positions: None,
        shape: [examples.len(), seq],
        tokens,
    }
}
