//! The fused linear cross-entropy on `CubeBackend`: the token-chunk loop.
//!
//! Per chunk of `C` tokens: `logits = h_c · Wᵀ (+ b)` (cuBLASLt on CUDA),
//! the cross-entropy kernel turns them into their gradient in place, then
//! `dh_c = dlogits · W` and `dW += dlogitsᵀ · h_c`. Across chunks `dW` (and
//! `db`) accumulate in f32 whatever the input dtype: each chunk's product is
//! computed with an f32 output, in vocabulary slices so that the f32
//! temporary stays at half a chunk of logits. When one chunk covers every
//! token nothing accumulates across chunks: each slice is cast to the input
//! dtype as soon as it is computed, and no f32 accumulator exists.
//! Extra memory: one chunk of logits and one f32 slice product, plus the
//! f32 `dW` accumulator when there are several chunks.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Int, Shape, Tensor, TensorMetadata, TensorPrimitive};
use burn_cubecl::kernel::matmul::{MatmulStrategy, matmul};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use bastile_cubecl::cross_entropy::CrossEntropyMode;

use super::LinearGrads;
use crate::backend::matmul::{matmul_blas, matmul_blas_accumulate};
use crate::fused::cube::{as_rows, contiguous_i32, empty_like, stride_multiple};
use crate::fused::{kernel, kernel_dtype};
use crate::launch_failure::failed;
use crate::ops::cross_entropy::LossSpec;
use crate::ops::cross_entropy::kernel::{Launch, problem};

type Cube<R, F, I, BT> = CubeBackend<R, F, I, BT>;

/// What a run of the loop computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Pass {
    /// Losses and `lse` only.
    Stats,
    /// Losses, `lse` and the gradients of the scaled loss sum.
    StatsAndGrads,
    /// Gradients for per-token upstream gradients (`dloss`, after the
    /// inputs), from the forward's `lse` (before it).
    Grads,
}

/// One run of the chunk loop. Inputs: `hidden, weight, bias?` (then `lse,
/// dloss` for [`Pass::Grads`]), and the labels; outputs: the per-token
/// `losses, lse` for the stats passes, then the gradients `hidden, weight,
/// bias?` for the gradient passes.
#[derive(Clone, Copy, Debug)]
pub(super) struct ChunkLoop {
    pub spec: LossSpec,
    pub pass: Pass,
    pub has_bias: bool,
}

kernel!(
    ChunkLoop,
    "bastile_linear_cross_entropy",
    |op, mut floats, mut ints| {
        let upstream = (op.pass == Pass::Grads).then(|| {
            let dloss = floats.pop().expect("dloss");
            (floats.pop().expect("lse"), dloss)
        });
        let bias = if op.has_bias { floats.pop() } else { None };
        let weight = floats.pop().expect("weight");
        let hidden = floats.pop().expect("hidden");
        let labels = ints.pop().expect("labels");
        let (stats, grads) =
            run::<R, F, I, BT>(hidden, weight, bias, labels, &op.spec, op.pass, upstream);
        let stats = stats.map(|(losses, lse)| [losses, lse]);
        stats
            .into_iter()
            .flatten()
            .chain(grads.map(LinearGrads::into_vec).unwrap_or_default())
            .collect()
    }
);

/// Tokens per chunk. Each chunk pays a fixed cost for the f32 `dW`
/// accumulation (reading and writing it: 8·V·H bytes of traffic in the
/// product's epilogue on cuBLASLt, 12·V·H elsewhere) against `6·C·H·V`
/// flops of matmuls: that cost is a share of the matmuls' time that only
/// depends on the chunk's tokens (about 6% at 4096). The chunk's logits
/// (`C·V` elements) take memory in proportion to `V/H`, which is large in
/// small models (Qwen3-0.6B: 148), so a chunk has `H` tokens within
/// 1024..=4096: its logits then weigh about as much as the weight. Up to
/// `max(C, 2048)` tokens run as one chunk, which needs no f32 accumulator:
/// in bf16 with `H ≥ 1024` the 4·V·H bytes it would take weigh as much as
/// 2048 tokens' logits. The chunk's logits stay within half of the
/// largest allocation the runtime makes (a quarter of device memory on
/// CUDA).
pub(crate) fn chunk_rows(
    tokens: usize,
    (vocab, hidden): (usize, usize),
    elem_size: usize,
    max_allocation: u64,
    requested: Option<usize>,
) -> usize {
    if let Some(c) = requested {
        return c.clamp(1, tokens.max(1));
    }
    let target = hidden.clamp(1024, 4096);
    let target = if tokens <= target.max(2048) {
        tokens
    } else {
        target
    };
    let by_memory = (max_allocation as usize / 2) / (vocab * elem_size).max(1);
    target.min(by_memory).min(tokens).max(1)
}

/// Vocabulary rows per f32 weight-gradient product: the product of a slice
/// (`rows × H × 4` bytes) stays within half of the chunk's logits
/// (`chunk × V × elem_size`), so slicing never raises the peak.
pub(crate) fn weight_slice_rows(
    chunk: usize,
    vocab: usize,
    hidden: usize,
    elem_size: usize,
) -> usize {
    (chunk * vocab * elem_size / (8 * hidden.max(1))).clamp(1, vocab.max(1))
}

fn float<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement, const D: usize>(
    t: CubeTensor<R>,
) -> Tensor<Cube<R, F, I, BT>, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

fn prim<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement, const D: usize>(
    t: Tensor<Cube<R, F, I, BT>, D>,
) -> CubeTensor<R> {
    t.into_primitive().tensor()
}

/// The weight gradient from its slices, in `dtype`: each f32 slice is
/// freed as soon as it is cast, and a single slice is not copied.
fn join_slices<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    slices: impl Iterator<Item = Tensor<Cube<R, F, I, BT>, 2>>,
    dtype: DType,
) -> Tensor<Cube<R, F, I, BT>, 2> {
    let mut parts: Vec<_> = slices.map(|part| part.cast(dtype)).collect();
    if parts.len() == 1 {
        parts.pop().expect("one slice")
    } else {
        Tensor::cat(parts, 0)
    }
}

/// `a · b` written in `out_dtype` (the operands' or f32): on cuBLASLt when
/// it takes the problem (CUDA, `matmul` patch on), else CubeCL's matmul.
fn mm<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    a: Tensor<Cube<R, F, I, BT>, 2>,
    b: Tensor<Cube<R, F, I, BT>, 2>,
    out_dtype: DType,
) -> Tensor<Cube<R, F, I, BT>, 2> {
    let (a, b) = (prim(a), prim(b));
    let out = matmul_blas(&a, &b, out_dtype).unwrap_or_else(|| {
        let shape = Shape::new([a.shape()[0], b.shape()[1]]);
        let like = a.clone();
        matmul(a, b, None, MatmulStrategy::default(), out_dtype).unwrap_or_else(|e| {
            failed("loss matmul", format!("{e:?}"));
            empty_like(&like, shape, out_dtype)
        })
    });
    float(out)
}

/// Runs the chunk loop: per-token `(losses, lse)` for the stats passes and
/// the gradients for the gradient passes.
#[allow(clippy::type_complexity)]
fn run<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    hidden: CubeTensor<R>,
    weight: CubeTensor<R>,
    bias: Option<CubeTensor<R>>,
    labels: CubeTensor<R>,
    spec: &LossSpec,
    pass: Pass,
    upstream: Option<(CubeTensor<R>, CubeTensor<R>)>,
) -> (
    Option<(CubeTensor<R>, CubeTensor<R>)>,
    Option<LinearGrads<FloatTensor<Cube<R, F, I, BT>>>>,
) {
    let client = hidden.client.clone();
    let dtype = hidden.dtype;
    let h = float::<R, F, I, BT, 2>(hidden);
    let w = float::<R, F, I, BT, 2>(weight);
    let b = bias.map(float::<R, F, I, BT, 1>);
    let [n, _] = h.dims();
    let [vocab, hidden_size] = w.dims();
    let labels: Tensor<Cube<R, F, I, BT>, 1, Int> = Tensor::from_primitive(contiguous_i32(labels));
    let chunk = chunk_rows(
        n,
        (vocab, hidden_size),
        dtype.size(),
        client.properties().memory.max_page_size,
        spec.chunk_size,
    );
    let (mode, row_inputs) = match (pass, upstream) {
        (Pass::Stats, _) => (CrossEntropyMode::Stats, None),
        (Pass::StatsAndGrads, _) => (CrossEntropyMode::StatsAndGrad, None),
        (Pass::Grads, None) => unreachable!("a gradient pass is given lse and dloss"),
        (Pass::Grads, Some((lse, dloss))) => (
            CrossEntropyMode::Grad,
            Some((
                float::<R, F, I, BT, 1>(burn_cubecl::kernel::into_contiguous(lse)),
                float::<R, F, I, BT, 1>(burn_cubecl::kernel::into_contiguous(dloss)),
            )),
        ),
    };
    let kernel_dtype = kernel_dtype(dtype).expect("validated dtype");
    let wt = w.clone().transpose();
    let mut losses = Vec::new();
    let mut lses = Vec::new();
    let mut dh = Vec::new();
    // `dW` per vocabulary slice: f32 accumulators across chunks, or the
    // slices in `dtype` when one chunk covers every token.
    let single_chunk = chunk >= n;
    let slice = weight_slice_rows(chunk, vocab, hidden_size, dtype.size());
    let mut dw: Vec<Option<Tensor<Cube<R, F, I, BT>, 2>>> = Vec::new();
    // On cuBLASLt, `dW` across chunks is instead one f32 accumulator that
    // each chunk's product adds into in its epilogue: no product to store
    // and add afterwards, no slices to join.
    let mut dw_sum: Option<CubeTensor<R>> = None;
    let mut db: Option<Tensor<Cube<R, F, I, BT>, 1>> = None;
    for start in (0..n).step_by(chunk) {
        let end = (start + chunk).min(n);
        let rows = end - start;
        let hc = h.clone().narrow(0, start, rows);
        let mut logits = mm(hc.clone(), wt.clone(), dtype);
        if let Some(b) = &b {
            logits = logits + b.clone().reshape([1, vocab]);
        }
        let (logits, logits_rows) = as_rows(prim(logits));
        let labels_c = labels.clone().narrow(0, start, rows).into_primitive();
        let (chunk_lse, row_scale) = match &row_inputs {
            Some((lse, dloss)) => (
                prim(lse.clone().narrow(0, start, rows)),
                Some(prim(dloss.clone().narrow(0, start, rows))),
            ),
            None => (empty_like(&logits, [rows].into(), DType::F32), None),
        };
        let chunk_losses = empty_like(&logits, [rows].into(), DType::F32);
        let p = problem(
            rows,
            vocab,
            kernel_dtype,
            stride_multiple(vocab, &[&logits_rows]),
            spec,
        );
        Launch {
            logits: &logits,
            logits_rows: &logits_rows,
            labels: &labels_c,
            grad: None,
            losses: &chunk_losses,
            lse: &chunk_lse,
            row_scale: row_scale.as_ref(),
        }
        .run(p, mode);
        if mode != CrossEntropyMode::Grad {
            losses.push(float::<R, F, I, BT, 1>(chunk_losses));
            lses.push(float::<R, F, I, BT, 1>(chunk_lse));
        }
        if mode == CrossEntropyMode::Stats {
            continue;
        }
        // The logits now hold their gradient.
        let dlogits = float::<R, F, I, BT, 2>(logits);
        dh.push(mm(dlogits.clone(), w.clone(), dtype));
        let weight_product = |v0: usize, rows: usize, out_dtype: DType| {
            let d = dlogits.clone().narrow(1, v0, rows).transpose();
            mm(d, hc.clone(), out_dtype)
        };
        if !single_chunk && dw.is_empty() {
            let (d, hc) = (prim(dlogits.clone().transpose()), prim(hc.clone()));
            dw_sum = match dw_sum.take() {
                None if start == 0 => matmul_blas(&d, &hc, DType::F32),
                Some(acc) if matmul_blas_accumulate(&d, &hc, &acc) => Some(acc),
                // cuBLASLt took the first chunk but not this one's shape.
                Some(acc) => Some(prim(
                    float::<R, F, I, BT, 2>(acc) + mm(float(d), float(hc), DType::F32),
                )),
                None => None,
            };
        }
        let slices = if dw_sum.is_some() { 0 } else { vocab };
        for (i, v0) in (0..slices).step_by(slice).enumerate() {
            let part = weight_product(v0, slice.min(vocab - v0), DType::F32);
            // Taken out of its slot so the addition runs in place.
            match dw.get_mut(i) {
                Some(slot) => *slot = slot.take().map(|acc| acc + part),
                // With one chunk nothing accumulates: down to `dtype` now.
                None if single_chunk => dw.push(Some(part.cast(dtype))),
                None => dw.push(Some(part)),
            }
        }
        if b.is_some() {
            let db_c = dlogits.sum_dim(0).reshape([vocab]).cast(DType::F32);
            db = Some(match db {
                Some(acc) => acc + db_c,
                None => db_c,
            });
        }
    }
    let stats = (mode != CrossEntropyMode::Grad)
        .then(|| (prim(Tensor::cat(losses, 0)), prim(Tensor::cat(lses, 0))));
    let grads = (mode != CrossEntropyMode::Stats).then(|| LinearGrads {
        hidden: prim(Tensor::cat(dh, 0)),
        weight: match dw_sum {
            Some(acc) => prim(float::<R, F, I, BT, 2>(acc).cast(dtype)),
            None => prim(join_slices(dw.into_iter().flatten(), dtype)),
        },
        bias: db.map(|db| prim(db.cast(dtype))),
    });
    (stats, grads)
}

#[cfg(test)]
mod tests {
    use super::chunk_rows;

    const GIB: u64 = 1 << 30;

    #[test]
    fn chunks_hold_hidden_size_tokens_and_short_inputs_run_whole() {
        let qwen3_small = (151_936, 1024);
        let chunk = |tokens, shape| chunk_rows(tokens, shape, 2, 20 * GIB, None);
        // Up to 2048 tokens: one chunk, no f32 accumulator.
        assert_eq!(chunk(2048, qwen3_small), 2048);
        assert_eq!(chunk(4096, qwen3_small), 1024);
        assert_eq!(chunk(131_072, qwen3_small), 1024);
        assert_eq!(chunk(4096, (128_256, 2048)), 2048);
        // Wide models keep chunks of 4096 (and one chunk up to there).
        assert_eq!(chunk(4096, (151_936, 4096)), 4096);
        assert_eq!(chunk(8192, (151_936, 4096)), 4096);
        assert_eq!(chunk(8192, (151_936, 8192)), 4096);
        // A requested size wins; the largest allocation bounds the logits.
        assert_eq!(chunk_rows(8192, qwen3_small, 2, 20 * GIB, Some(300)), 300);
        assert_eq!(chunk_rows(8192, qwen3_small, 2, GIB, None), 1024);
        assert_eq!(chunk_rows(8192, qwen3_small, 2, GIB / 4, None), 441);
    }
}
