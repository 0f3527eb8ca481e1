//! Cross-entropy's kernel launches on `CubeBackend`: the row kernel shared
//! by the standalone loss and the chunks of the fused linear cross-entropy.

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;

use bastile_cubecl::cross_entropy::{
    self, CrossEntropyBuffers, CrossEntropyMode, CrossEntropyProblem, RowScale,
};
use bastile_cubecl::rows::Rows;

use super::{CrossEntropy, CrossEntropyBackward, LossSpec};
use crate::fused::cube::{
    as_rows, contiguous_i32, empty_like, row_alignment, rows_cols, stride_multiple,
};
use crate::fused::{DeviceQuery, kernel, kernel_dtype, unpack};
use crate::launch_failure::launch;

/// Whether the cross-entropy row kernel takes logits of `dtype`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CrossEntropyQuery {
    pub dtype: DType,
}

impl DeviceQuery for CrossEntropyQuery {
    type Answer = bool;

    fn ask<R: CubeRuntime>(&self, device: &R::Device) -> bool {
        let Some(dtype) = kernel_dtype(self.dtype) else {
            return false;
        };
        let client = R::client(device);
        let probe = problem(
            1,
            64,
            dtype,
            row_alignment(64, dtype.size()),
            &LossSpec::probe(),
        );
        cross_entropy::supported(&client, device, &probe)
    }
}

kernel!(CrossEntropy, "bastile_cross_entropy", |op, floats, ints| {
    let ([logits], [labels]) = (unpack(floats), unpack(ints));
    let (losses, lse) = forward(logits, labels, &op.spec);
    vec![losses, lse]
});

kernel!(
    CrossEntropyBackward,
    "bastile_cross_entropy_grad",
    |op, floats, ints| {
        let ([logits, lse, dloss], [labels]) = (unpack(floats), unpack(ints));
        vec![backward(logits, labels, lse, dloss, &op.spec)]
    }
);

/// The kernel problem for `rows × vocab` logits; mode and scales set by the
/// caller.
pub(crate) fn problem(
    rows: usize,
    vocab: usize,
    dtype: bastile_cubecl::FloatDtype,
    stride_multiple: usize,
    spec: &LossSpec,
) -> CrossEntropyProblem {
    CrossEntropyProblem {
        rows,
        vocab,
        slice: None,
        dtype,
        stride_multiple,
        // Labels are checked against [0, V) before any launch, so an ignore
        // index beyond i32 can match no label: any negative stand-in works.
        ignore_index: i32::try_from(spec.ignore_index).unwrap_or(i32::MIN),
        label_smoothing: spec.label_smoothing as f32,
        z_loss: spec.z_loss as f32,
        softcap: spec.softcap.map(|c| c as f32),
        scale: spec.scale as f32,
        mode: CrossEntropyMode::Stats,
        row_scale: RowScale::None,
    }
}

/// One launch over `logits` (rows of the vocabulary). The gradient goes to
/// `grad`, or over the logits when `grad` is `None`; `lse` is read in the
/// gradient-only mode and written otherwise, like `losses`.
pub(crate) struct Launch<'a, R: CubeRuntime> {
    pub logits: &'a CubeTensor<R>,
    pub logits_rows: &'a Rows,
    pub labels: &'a CubeTensor<R>,
    pub grad: Option<&'a Rows>,
    pub losses: &'a CubeTensor<R>,
    pub lse: &'a CubeTensor<R>,
    pub row_scale: Option<&'a CubeTensor<R>>,
}

impl<R: CubeRuntime> Launch<'_, R> {
    pub(crate) fn run(&self, mut problem: CrossEntropyProblem, mode: CrossEntropyMode) {
        problem.mode = mode;
        problem.row_scale = match self.row_scale {
            None => RowScale::None,
            Some(s) if s.shape().num_elements() == 1 && problem.rows != 1 => RowScale::Uniform,
            Some(_) => RowScale::PerRow,
        };
        let buffers = CrossEntropyBuffers {
            logits: self.logits_rows.clone(),
            labels: self.labels.handle.clone(),
            grad: self.grad.cloned(),
            losses: self.losses.handle.clone(),
            lse: self.lse.handle.clone(),
            row_scale: self.row_scale.map(|s| s.handle.clone()),
        };
        let x = self.logits;
        launch("cross-entropy", || {
            cross_entropy::run(&x.client, &x.device, &problem, &buffers)
        });
    }
}

fn f32_vector<R: CubeRuntime>(like: &CubeTensor<R>, n: usize) -> CubeTensor<R> {
    empty_like(like, Shape::new([n]), DType::F32)
}

/// Per-token `(losses, lse)` of `logits`.
fn forward<R: CubeRuntime>(
    logits: CubeTensor<R>,
    labels: CubeTensor<R>,
    spec: &LossSpec,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let (logits, rows) = as_rows(logits);
    let (n, vocab) = rows_cols(&logits.shape());
    let labels = contiguous_i32(labels);
    let losses = f32_vector(&logits, n);
    let lse = f32_vector(&logits, n);
    let dtype = kernel_dtype(logits.dtype).expect("validated dtype");
    let p = problem(n, vocab, dtype, stride_multiple(vocab, &[&rows]), spec);
    Launch {
        logits: &logits,
        logits_rows: &rows,
        labels: &labels,
        grad: None,
        losses: &losses,
        lse: &lse,
        row_scale: None,
    }
    .run(p, CrossEntropyMode::Stats);
    (losses, lse)
}

/// The logits gradient for upstream f32 gradients `dloss` (`[1]` or `[N]`),
/// written over the logits when nothing else holds them.
fn backward<R: CubeRuntime>(
    logits: CubeTensor<R>,
    labels: CubeTensor<R>,
    lse: CubeTensor<R>,
    dloss: CubeTensor<R>,
    spec: &LossSpec,
) -> CubeTensor<R> {
    // Checked before `as_rows` takes its own reference to the buffer.
    let in_place = logits.can_mut();
    let (logits, rows) = as_rows(logits);
    let (n, vocab) = rows_cols(&logits.shape());
    let labels = contiguous_i32(labels);
    let lse = into_contiguous(lse);
    let dloss = into_contiguous(dloss);
    let (grad, grad_rows) = if in_place {
        (logits.clone(), None)
    } else {
        let (g, r) = as_rows(empty_like(&logits, logits.shape(), logits.dtype));
        (g, Some(r))
    };
    let dtype = kernel_dtype(logits.dtype).expect("validated dtype");
    let all_rows: Vec<&Rows> = std::iter::once(&rows).chain(grad_rows.as_ref()).collect();
    let p = problem(n, vocab, dtype, stride_multiple(vocab, &all_rows), spec);
    let losses = f32_vector(&logits, 1);
    Launch {
        logits: &logits,
        logits_rows: &rows,
        labels: &labels,
        grad: grad_rows.as_ref(),
        losses: &losses,
        lse: &lse,
        row_scale: Some(&dloss),
    }
    .run(p, CrossEntropyMode::Grad);
    grad
}
