//! Cross-entropy on given logits: options, the checked public entry point,
//! the composite reference and the autodiff node of the fused op.
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

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Int, Tensor, TensorMetadata};
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};

use crate::ops::{check_float, check_same_device, float};
use crate::{BastileBackend, BastileError};

/// How per-token losses are combined.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
pub enum Reduction {
    /// The sum over counted tokens divided by their number (or by
    /// [`CrossEntropyOptions::normalizer`]).
    #[default]
    Mean,
    /// The sum over counted tokens.
    Sum,
    /// One loss per token (0 at ignored tokens).
    None,
}

/// Options of the cross-entropy losses.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CrossEntropyOptions {
    /// Tokens with this label count for nothing (PyTorch's default, -100).
    pub ignore_index: i64,
    pub reduction: Reduction,
    /// With [`Reduction::Mean`], divide by this instead of the number of
    /// counted tokens: the token count of all micro-batches of a
    /// gradient-accumulation step, so their gradients add up to the mean.
    pub normalizer: Option<f64>,
    /// ε in `[0, 1]`: the target is `(1−ε)·onehot + ε/V`.
    pub label_smoothing: f64,
    /// λ ≥ 0 of the `λ·lse²` z-loss term.
    pub z_loss: f64,
    /// Soft cap `c > 0` of the logits (`c · tanh(x / c)`).
    pub softcap: Option<f64>,
    /// Tokens per chunk of the fused linear cross-entropy; chosen from the
    /// token count, vocabulary and device memory when `None`.
    pub chunk_size: Option<usize>,
    /// Check the labels on the device and hand the result back as
    /// [`CrossEntropyOutput::label_check`] instead of waiting for it: the
    /// loss is queued without reading anything back, and the caller reads
    /// the check when it reads the loss (a training step does so once, at
    /// its end). Until then an out-of-range label counts for nothing.
    pub defer_label_check: bool,
}

impl Default for CrossEntropyOptions {
    fn default() -> Self {
        Self {
            ignore_index: -100,
            reduction: Reduction::Mean,
            normalizer: None,
            label_smoothing: 0.0,
            z_loss: 0.0,
            softcap: None,
            chunk_size: None,
            defer_label_check: false,
        }
    }
}

impl CrossEntropyOptions {
    pub fn with_ignore_index(self, ignore_index: i64) -> Self {
        Self {
            ignore_index,
            ..self
        }
    }

    pub fn with_reduction(self, reduction: Reduction) -> Self {
        Self { reduction, ..self }
    }

    pub fn with_normalizer(self, normalizer: f64) -> Self {
        Self {
            normalizer: Some(normalizer),
            ..self
        }
    }

    pub fn with_label_smoothing(self, label_smoothing: f64) -> Self {
        Self {
            label_smoothing,
            ..self
        }
    }

    pub fn with_z_loss(self, z_loss: f64) -> Self {
        Self { z_loss, ..self }
    }

    pub fn with_softcap(self, softcap: f64) -> Self {
        Self {
            softcap: Some(softcap),
            ..self
        }
    }

    pub fn with_chunk_size(self, chunk_size: usize) -> Self {
        Self {
            chunk_size: Some(chunk_size),
            ..self
        }
    }

    /// See [`CrossEntropyOptions::defer_label_check`].
    pub fn with_deferred_label_check(self) -> Self {
        Self {
            defer_label_check: true,
            ..self
        }
    }

    fn validate(&self) -> Result<(), BastileError> {
        let bad = |why: String| Err(BastileError::Config(why));
        if !(0.0..=1.0).contains(&self.label_smoothing) {
            return bad(format!(
                "label_smoothing must lie in [0, 1], got {}",
                self.label_smoothing
            ));
        }
        if !(self.z_loss.is_finite() && self.z_loss >= 0.0) {
            return bad(format!(
                "z_loss must be finite and non-negative, got {}",
                self.z_loss
            ));
        }
        if let Some(c) = self.softcap
            && !(c.is_finite() && c > 0.0)
        {
            return bad(format!("softcap must be finite and positive, got {c}"));
        }
        if let Some(n) = self.normalizer
            && !(n.is_finite() && n > 0.0)
        {
            return bad(format!("normalizer must be finite and positive, got {n}"));
        }
        if self.chunk_size == Some(0) {
            return bad("chunk_size must be at least 1".into());
        }
        Ok(())
    }
}

/// What the backend methods take: the validated options, with the factor
/// the summed loss is multiplied by (`1/normalizer` for a mean) resolved.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossSpec {
    pub ignore_index: i64,
    pub reduction: Reduction,
    pub label_smoothing: f64,
    pub z_loss: f64,
    pub softcap: Option<f64>,
    /// Multiplies the summed loss (`Mean`, `Sum`) and every gradient.
    pub scale: f64,
    pub chunk_size: Option<usize>,
}

impl LossSpec {
    /// A plain spec, for support checks.
    pub(crate) fn probe() -> Self {
        Self {
            ignore_index: -100,
            reduction: Reduction::Mean,
            label_smoothing: 0.0,
            z_loss: 0.0,
            softcap: None,
            scale: 1.0,
            chunk_size: None,
        }
    }
}

/// `(loss, lse)` as the backend methods return them.
pub type LossPair<T> = (T, T);

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
        let position = Tensor::<B, 1, Int>::arange(0..rows as i64, &labels.device())
            .mask_fill(bad.bool_not(), rows as i64)
            .min();
        let label = labels
            .clone()
            .gather(0, position.clone().clamp_max(rows as i64 - 1));
        let check = Self {
            found: Tensor::cat(vec![position, label], 0),
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
    pub fn failed(&self) -> Tensor<B, 1, burn::tensor::Bool> {
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

/// An int tensor's values, read back.
pub(crate) fn read_ints<B: Backend, const D: usize>(
    t: Tensor<B, D, Int>,
) -> Result<Vec<i64>, BastileError> {
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

/// What a mean divides the summed loss by on the host: the normalizer, else
/// the token count when it was read back. `None` leaves a mean's count on
/// the device: [`spec`] then sums and [`output`] divides by the count.
fn host_divisor(options: &CrossEntropyOptions, counted: Option<usize>) -> Option<f64> {
    options.normalizer.or(counted.map(|c| c.max(1) as f64))
}

/// Validates the options and resolves the loss scale.
pub(crate) fn spec(
    options: &CrossEntropyOptions,
    counted: Option<usize>,
) -> Result<LossSpec, BastileError> {
    options.validate()?;
    let scale = match (options.reduction, host_divisor(options, counted)) {
        (Reduction::Mean, Some(divisor)) => 1.0 / divisor,
        _ => 1.0,
    };
    Ok(LossSpec {
        ignore_index: options.ignore_index,
        reduction: options.reduction,
        label_smoothing: options.label_smoothing,
        z_loss: options.z_loss,
        softcap: options.softcap,
        scale,
        chunk_size: options.chunk_size,
    })
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
    let (loss, lse) = B::cross_entropy(
        logits.into_primitive().tensor(),
        labels.clone().into_primitive(),
        spec,
    );
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

#[derive(Debug)]
struct CrossEntropyBackward;

impl<B: BastileBackend> Backward<B, 1> for CrossEntropyBackward {
    type State = (FloatTensor<B>, IntTensor<B>, FloatTensor<B>, LossSpec);

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node] = ops.parents;
        let dloss = grads.consume::<B>(&ops.node);
        let (logits, labels, lse, spec) = ops.state;
        let dlogits = B::cross_entropy_backward(logits, labels, lse, dloss, spec);
        if let Some(node) = node {
            grads.register::<B>(node.id, dlogits);
        }
    }
}

/// `Autodiff<B>`'s cross-entropy: one node saving the logits and the
/// per-token `lse`, whose backward is `B`'s fused gradient kernel; the
/// composite graph when `B` does not fuse it.
pub(crate) fn autodiff<B: BastileBackend, C: CheckpointStrategy>(
    logits: FloatTensor<Autodiff<B, C>>,
    labels: IntTensor<B>,
    spec: LossSpec,
) -> LossPair<FloatTensor<Autodiff<B, C>>> {
    if !B::cross_entropy_fused(
        &B::float_device(&logits.primitive),
        logits.primitive.dtype(),
    ) {
        return composite::<Autodiff<B, C>>(logits, labels, spec);
    }
    match CrossEntropyBackward
        .prepare::<C>([logits.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (loss, lse) = B::cross_entropy(logits.primitive.clone(), labels.clone(), spec);
            let out = prep.finish((logits.primitive, labels, lse.clone(), spec), loss);
            (out, <Autodiff<B, C> as AutodiffBackend>::from_inner(lse))
        }
        OpsKind::UnTracked(prep) => {
            let (loss, lse) = B::cross_entropy(logits.primitive, labels, spec);
            (
                prep.finish(loss),
                <Autodiff<B, C> as AutodiffBackend>::from_inner(lse),
            )
        }
    }
}
