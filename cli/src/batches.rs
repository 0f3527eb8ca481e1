//! Examples into padded micro-batches, reshuffled every epoch.

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
    pub fn skip(&mut self, n: usize) {
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

    /// The indices of the next `n` examples.
    pub fn take(&mut self, n: usize) -> Vec<usize> {
        (0..n).map(|_| self.advance()).collect()
    }
}

/// A padded micro-batch on the host: ids and labels `[batch, seq]`
/// row-major, padded on the right (pad ids, ignored labels).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Padded {
    pub ids: Vec<i64>,
    pub labels: Vec<i64>,
    pub shape: [usize; 2],
    /// Tokens that are not padding.
    pub tokens: usize,
}

impl Padded {
    /// The batch as tensors on `device`.
    pub fn to_device<B: AutodiffBackend>(self, device: &B::Device) -> MicroBatch<B> {
        MicroBatch {
            ids: Tensor::<B, 2, Int>::from_data(TensorData::new(self.ids, self.shape), device),
            labels: Tensor::<B, 2, Int>::from_data(
                TensorData::new(self.labels, self.shape),
                device,
            ),
        }
    }
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
        shape: [examples.len(), seq],
        tokens,
    }
}
