//! The label check of the cross-entropy losses: on the device, or read
//! back once together with the token count.

use burn::tensor::backend::Backend;
use burn::tensor::{Bool, Int, Tensor};

use super::CrossEntropyOptions;
use crate::BastileError;

/// A check of a loss's labels computed on the device: the first label that
/// is neither a class in `[0, V)` nor the ignore index. Nothing is read
/// back until [`LabelCheck::result`] (or the caller reads [`LabelCheck::found`]
/// together with other results and passes the values to
/// [`LabelCheck::error`]).
#[derive(Clone, Debug)]
pub struct LabelCheck<B: Backend> {
    /// `[position, label]` of the first offending label; the position is
    /// `rows` when there is none.
    found: Tensor<B, 1, Int>,
    rows: usize,
    vocab: usize,
    ignore_index: i64,
}

impl<B: Backend> LabelCheck<B> {
    /// Queues the check of `labels` (`[N]`, `N ≥ 1`) and the count of the
    /// tokens that count (valid labels other than the ignore index).
    pub fn new(
        labels: &Tensor<B, 1, Int>,
        vocab: usize,
        ignore_index: i64,
    ) -> (Self, Tensor<B, 1, Int>) {
        let [rows] = labels.dims();
        let counted = labels.clone().not_equal_elem(ignore_index);
        let outside = labels
            .clone()
            .lower_elem(0)
            .bool_or(labels.clone().greater_equal_elem(vocab as i64));
        let bad = counted.clone().bool_and(outside);
        let tokens = counted.bool_and(bad.clone().bool_not()).int().sum();
        let check = Self {
            found: first_flagged(labels, bad),
            rows,
            vocab,
            ignore_index,
        };
        (check, tokens)
    }

    /// `[position, label]` of the first out-of-range label (the position is
    /// the number of labels when there is none), on the device.
    pub fn found(&self) -> Tensor<B, 1, Int> {
        self.found.clone()
    }

    /// `[1]` on the device: whether a label is out of range.
    pub fn failed(&self) -> Tensor<B, 1, Bool> {
        self.found.clone().slice(0..1).lower_elem(self.rows as i64)
    }

    /// The error that `found`, the values of [`LabelCheck::found`], report;
    /// `None` when every label is valid.
    pub fn error(&self, found: [i64; 2]) -> Option<BastileError> {
        let [position, label] = found;
        (position < self.rows as i64).then(|| {
            BastileError::Shape(format!(
                "label {label} at position {position} is outside the vocabulary [0, {}) and is not the ignore index {}",
                self.vocab, self.ignore_index
            ))
        })
    }

    /// Reads the check (this waits for the device) and returns its error.
    pub fn result(self) -> Result<(), BastileError> {
        let found = read_ints(self.found.clone())?;
        match self.error([found[0], found[1]]) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// `[position, value]` of the first element of `values` (`[N]`, `N ≥ 1`)
/// that `flagged` marks, on the device; the position is `N` (and the value
/// the last element's) when none is. What the label and input-id checks
/// find and read back with a step's other results.
pub fn first_flagged<B: Backend>(
    values: &Tensor<B, 1, Int>,
    flagged: Tensor<B, 1, Bool>,
) -> Tensor<B, 1, Int> {
    let [n] = values.dims();
    let position = Tensor::<B, 1, Int>::arange(0..n as i64, &values.device())
        .mask_fill(flagged.bool_not(), n as i64)
        .min();
    let value = values
        .clone()
        .gather(0, position.clone().clamp_max(n as i64 - 1));
    Tensor::cat(vec![position, value], 0)
}

/// An int tensor's values, read back.
fn read_ints<B: Backend, const D: usize>(t: Tensor<B, D, Int>) -> Result<Vec<i64>, BastileError> {
    t.into_data()
        .convert::<i64>()
        .into_vec::<i64>()
        .map_err(|e| BastileError::DType(format!("labels could not be read: {e:?}")))
}

/// What [`check_labels`] found.
pub(crate) struct CheckedLabels<B: Backend> {
    /// The count of the tokens that count, on the device.
    pub tokens: Tensor<B, 1, Int>,
    /// The same count, when it was read back.
    pub counted: Option<usize>,
    /// The check, when it was left on the device.
    pub deferred: Option<LabelCheck<B>>,
}

/// Checks the labels against the vocabulary and counts the tokens: on the
/// device, handed back as they are, with
/// [`CrossEntropyOptions::defer_label_check`]; otherwise read back in one
/// transfer, an offending label then an error here.
pub(crate) fn check_labels<B: Backend>(
    labels: &Tensor<B, 1, Int>,
    vocab: usize,
    options: &CrossEntropyOptions,
) -> Result<CheckedLabels<B>, BastileError> {
    let (check, tokens) = LabelCheck::new(labels, vocab, options.ignore_index);
    if options.defer_label_check {
        return Ok(CheckedLabels {
            tokens,
            counted: None,
            deferred: Some(check),
        });
    }
    let read = read_ints(Tensor::cat(vec![check.found(), tokens.clone()], 0))?;
    if let Some(e) = check.error([read[0], read[1]]) {
        return Err(e);
    }
    Ok(CheckedLabels {
        tokens,
        counted: Some(read[2] as usize),
        deferred: None,
    })
}
