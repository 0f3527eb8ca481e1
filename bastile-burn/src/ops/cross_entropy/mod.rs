//! Cross-entropy on given logits: the checked public entry point, the
//! composite reference and the fused op's declaration; its options in
//! `options.rs`, the label check in `labels.rs`, its autodiff node in
//! `autodiff.rs`, its kernel launches in `kernel.rs` (shared with the fused
//! linear cross-entropy).
//!
//! Semantics (PyTorch's `cross_entropy` with `ignore_index` and
//! `label_smoothing`, plus the z-loss and logit soft cap of PaLM / Gemma
//! style training), per token with logits `x` of width `V` and label `y`, in
//! f32 whatever the logits dtype:
//!
//! ```text
//! z = c · tanh(x / c)  (soft cap c, if any)      lse = log Σ_j exp(z_j)
//! loss_t = lse − (1−ε)·z_y − (ε/V)·Σ_j z_j + λ·lse²
//! ```
//!
//! Tokens whose label is `ignore_index` contribute 0. `Mean` divides the
//! sum by the number of counted tokens (or by an external normalizer, for
//! gradient accumulation over micro-batches), `Sum` does not, `None` returns
//! the per-token losses.

mod autodiff;
pub(crate) mod kernel;
mod labels;
mod options;

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Device, Int, Shape, Tensor, TensorMetadata};

use crate::fused::{In, KernelBackend, Out, TensorSpec, fused_op, unpack};
use crate::ops::{check_float, check_same_device, f32_of, float, reduce_rows};
use crate::patches::Op;
use crate::{BastileBackend, BastileError};
pub use kernel::CrossEntropyQuery;
pub(crate) use labels::{CheckedLabels, check_labels};
pub use labels::{LabelCheck, first_flagged};
use options::host_divisor;
pub(crate) use options::spec;
pub use options::{CrossEntropyOptions, LossPair, LossSpec, Reduction, WeightGradSum};

/// A loss and its statistics.
#[derive(Clone, Debug)]
pub struct CrossEntropyOutput<B: Backend> {
    /// f32: shape `[1]` for `Mean` / `Sum`, the per-token losses `[N]` for
    /// `None`. The z-loss term is included.
    pub loss: Tensor<B, 1>,
    /// The z-loss part of `loss` (same reduction, detached); `None` when the
    /// z-loss coefficient is 0.
    pub z_loss: Option<Tensor<B, 1>>,
    /// Per-token log-sum-exp of the (capped) logits, f32, detached.
    pub lse: Tensor<B, 1>,
    /// How many tokens counted (labels other than the ignore index), `[1]`
    /// on the device.
    pub tokens: Tensor<B, 1, Int>,
    /// The labels' check, still on the device, with
    /// [`CrossEntropyOptions::defer_label_check`]; `None` when the labels
    /// were checked before the loss was computed.
    pub label_check: Option<LabelCheck<B>>,
}

/// Builds the public output from the backend's `(loss, lse)`.
pub(crate) fn output<B: Backend>(
    loss: FloatTensor<B>,
    lse: FloatTensor<B>,
    labels: Tensor<B, 1, Int>,
    spec: &LossSpec,
    checked: CheckedLabels<B>,
    options: &CrossEntropyOptions,
) -> CrossEntropyOutput<B> {
    let lse = float::<B, 1>(lse).detach();
    let mut z_loss = (spec.z_loss > 0.0).then(|| {
        let counted = labels.not_equal_elem(spec.ignore_index).float();
        let rows = lse.clone().square() * counted * spec.z_loss;
        reduce(rows, spec)
    });
    let mut loss = float::<B, 1>(loss);
    // A mean whose count stayed on the device: [`spec`] left it a sum.
    if spec.reduction == Reduction::Mean && host_divisor(options, checked.counted).is_none() {
        let count = checked.tokens.clone().float().clamp_min(1.0);
        loss = loss / count.clone();
        z_loss = z_loss.map(|z| z / count);
    }
    CrossEntropyOutput {
        loss,
        z_loss,
        lse,
        tokens: checked.tokens,
        label_check: checked.deferred,
    }
}

/// `Mean` / `Sum`: the scaled sum as a `[1]` tensor; `None`: as is.
pub(crate) fn reduce<B: Backend>(rows: Tensor<B, 1>, spec: &LossSpec) -> Tensor<B, 1> {
    match spec.reduction {
        Reduction::None => rows,
        Reduction::Mean | Reduction::Sum => rows.sum() * spec.scale,
    }
}

/// Cross-entropy of `logits` `[N, V]` against `labels` `[N]`.
///
/// Errors on mismatched shapes or devices, non-float logits, invalid
/// options, and labels outside `[0, V)` that are not the ignore index (the
/// labels are read once to check them and to count the tokens, unless
/// [`CrossEntropyOptions::defer_label_check`] hands the check back).
///
/// # Shapes
///
/// - `logits`: `[N, V]`
/// - `labels`: `[N]`
/// - output: [`CrossEntropyOutput`], its `loss` `[1]` (`Mean`, `Sum`) or `[N]` (`None`), its `lse` `[N]`
pub fn cross_entropy<B: BastileBackend>(
    logits: Tensor<B, 2>,
    labels: Tensor<B, 1, Int>,
    options: CrossEntropyOptions,
) -> Result<CrossEntropyOutput<B>, BastileError> {
    check_float("cross-entropy logits", logits.dtype())?;
    let [n, vocab] = logits.dims();
    check_tokens("logits", n, vocab, &labels)?;
    check_same_device("logits", &logits.device(), "labels", &labels.device())?;
    let checked = check_labels(&labels, vocab, &options)?;
    let spec = spec(&options, checked.counted)?;
    let input = (
        logits.into_primitive().tensor(),
        labels.clone().into_primitive(),
    );
    let (loss, lse) = B::run(&CrossEntropy { spec }, input);
    Ok(output(loss, lse, labels, &spec, checked, &options))
}

/// Errors unless there is at least one token and one class and the labels
/// have one entry per row.
pub(crate) fn check_tokens<B: Backend>(
    what: &str,
    n: usize,
    vocab: usize,
    labels: &Tensor<B, 1, Int>,
) -> Result<(), BastileError> {
    let [labels_n] = labels.dims();
    if n == 0 || vocab == 0 {
        return Err(BastileError::Shape(format!(
            "cross-entropy needs at least one token and one class, got {what} of {n} rows × {vocab} classes"
        )));
    }
    if labels_n != n {
        return Err(BastileError::Shape(format!(
            "{what} have {n} rows but labels have {labels_n} entries"
        )));
    }
    Ok(())
}

/// The logits as f32, soft-capped.
fn capped<B: Backend>(logits: Tensor<B, 2>, spec: &LossSpec) -> Tensor<B, 2> {
    let z = logits.cast(DType::F32);
    match spec.softcap {
        Some(c) => (z / c).tanh() * c,
        None => z,
    }
}

/// Labels with the entries that do not count replaced by class 0 (for
/// gathers), and the f32 mask of counted tokens. As in the kernels, a
/// label outside `[0, vocab)` (which a deferred label check reports later)
/// counts for nothing, like the ignore index.
fn counted<B: Backend>(
    labels: Tensor<B, 1, Int>,
    vocab: usize,
    spec: &LossSpec,
) -> (Tensor<B, 1, Int>, Tensor<B, 1>) {
    let skipped = labels
        .clone()
        .equal_elem(spec.ignore_index)
        .bool_or(labels.clone().lower_elem(0))
        .bool_or(labels.clone().greater_equal_elem(vocab as i64));
    let safe = labels.mask_fill(skipped.clone(), 0);
    (safe, skipped.bool_not().float())
}

/// Reference forward with plain Burn ops: `(loss, lse)`, both f32.
pub fn composite<B: Backend>(
    logits: FloatTensor<B>,
    labels: IntTensor<B>,
    spec: LossSpec,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let logits = float::<B, 2>(logits);
    let labels = Tensor::<B, 1, Int>::from_primitive(labels);
    let [n, vocab] = logits.dims();
    let z = capped(logits, &spec);
    let m = z.clone().detach().max_dim(1);
    let lse = (z.clone() - m.clone()).exp().sum_dim(1).log() + m;
    let (safe, counted) = counted(labels, vocab, &spec);
    let z_label = z.clone().gather(1, safe.reshape([n, 1]));
    let eps = spec.label_smoothing;
    let mut rows = lse.clone() - z_label * (1.0 - eps);
    if eps > 0.0 {
        rows = rows - z.mean_dim(1) * eps;
    }
    if spec.z_loss > 0.0 {
        rows = rows + lse.clone().square() * spec.z_loss;
    }
    let rows = rows.reshape([n]) * counted;
    (
        reduce(rows, &spec).into_primitive().tensor(),
        lse.reshape([n]).into_primitive().tensor(),
    )
}

/// Reference gradient with plain Burn ops: the logits gradient (in the
/// logits dtype) of the loss, given its `lse` and the upstream gradient
/// `dloss` (`[1]` for `Mean` / `Sum`, `[N]` for `None`).
pub fn composite_backward<B: Backend>(
    logits: FloatTensor<B>,
    labels: IntTensor<B>,
    lse: FloatTensor<B>,
    dloss: FloatTensor<B>,
    spec: LossSpec,
) -> FloatTensor<B> {
    let logits = float::<B, 2>(logits);
    let labels = Tensor::<B, 1, Int>::from_primitive(labels);
    let dtype = logits.dtype();
    let device = logits.device();
    let [n, vocab] = logits.dims();
    let x = logits.cast(DType::F32);
    let z = capped(x.clone(), &spec);
    let lse = float::<B, 1>(lse).reshape([n, 1]);
    let eps = spec.label_smoothing;
    let p = (z - lse.clone()).exp();
    let mut d = p * (lse * (2.0 * spec.z_loss) + 1.0) - eps / vocab as f64;
    let (safe, counted) = counted(labels, vocab, &spec);
    let classes = Tensor::<B, 1, Int>::arange(0..vocab as i64, &device)
        .reshape([1, vocab])
        .expand([n, vocab]);
    let onehot = classes
        .equal(safe.reshape([n, 1]).expand([n, vocab]))
        .float();
    d = d - onehot * (1.0 - eps);
    if let Some(c) = spec.softcap {
        // d tanh(u)/du = 1/cosh²(u), cosh written with exponentials.
        let u = x / c;
        let cosh = (u.clone().exp() + u.neg().exp()) / 2.0;
        d = d / cosh.square();
    }
    let dloss = float::<B, 1>(dloss).cast(DType::F32);
    // `[N]` per-token upstream gradients, or one `[1]` broadcast to all.
    let factor = counted * dloss * spec.scale;
    (d * factor.reshape([n, 1]))
        .cast(dtype)
        .into_primitive()
        .tensor()
}

/// Cross-entropy of `(logits [N, V], labels [N])`: `(loss, lse)`, both
/// f32, the loss reduced as `spec` says and `lse` per token.
#[derive(Clone, Copy, Debug)]
pub struct CrossEntropy {
    pub spec: LossSpec,
}

/// The logits gradient of [`CrossEntropy`] from `(logits, labels, lse,
/// dloss)`, `dloss` the upstream gradient of its loss.
#[derive(Clone, Copy, Debug)]
pub struct CrossEntropyBackward {
    pub spec: LossSpec,
}

fn problem_of<B: Backend>(logits: &FloatTensor<B>) -> (Device<B>, CrossEntropyQuery) {
    let query = CrossEntropyQuery {
        dtype: logits.dtype(),
    };
    (B::float_device(logits), query)
}

fused_op! {
    CrossEntropy: Some(Op::CrossEntropy), (F, I) => LossPair<F>, differentiable,
    |_, (logits, _)| -> CrossEntropyQuery { problem_of::<B>(logits) }

    fn composite<B: Backend>(&self, (logits, labels): In<Self, B>) -> Out<Self, B> {
        composite::<B>(logits, labels, self.spec)
    }

    fn kernels<K: KernelBackend>(&self, _: (), (logits, labels): In<Self, K>) -> Out<Self, K> {
        let per_token = TensorSpec::new(Shape::new([logits.shape()[0]]), DType::F32);
        let outputs = vec![per_token.clone(), per_token];
        let [rows, lse] = unpack(K::launch(self, vec![logits], vec![labels], outputs));
        (reduce_rows::<K>(rows, &self.spec), lse)
    }
}

fused_op! {
    CrossEntropyBackward: Some(Op::CrossEntropy), (F, I, F, F) => F,
    |_, (logits, ..)| -> CrossEntropyQuery { problem_of::<B>(logits) }

    fn composite<B: Backend>(&self, (logits, labels, lse, dloss): In<Self, B>) -> Out<Self, B> {
        composite_backward::<B>(logits, labels, lse, dloss, self.spec)
    }

    fn kernels<K: KernelBackend>(&self, _: (), input: In<Self, K>) -> Out<Self, K> {
        let (logits, labels, lse, dloss) = input;
        let outputs = vec![TensorSpec::of(&logits)];
        let floats = vec![logits, lse, f32_of::<K>(dloss)];
        let [dlogits] = unpack(K::launch(self, floats, vec![labels], outputs));
        dlogits
    }
}
