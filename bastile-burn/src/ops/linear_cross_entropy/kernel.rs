//! The fused linear cross-entropy on `CubeBackend`: the token-chunk loop.
//!
//! Per chunk of `C` tokens: `logits = h_c · Wᵀ (+ b)` (cuBLASLt on CUDA),
//! the cross-entropy kernel turns them into their gradient in place, then
//! `dh_c = dlogits · W` (and `db` sums in f32). When one chunk covers every
//! token, `dW = dlogitsᵀ · h` follows from the same logits. With several
//! chunks, [`WeightGradSum::Exact`] takes `dW` in a second
//! pass by slices of the vocabulary: each slice's logits for every token
//! are computed again, turned into their gradient from the rows' `lse`, and
//! `dW_s = dlogits_sᵀ · h` is one product over every token, written into
//! `dW`'s rows. So `dW` is summed in f32 inside the products and rounded
//! once, with no f32 `V × H` accumulator, for a third more matmul work.
//! [`WeightGradSum::Chunks`] (the default) instead adds each chunk's `dlogits_cᵀ · h_c`
//! into `dW` in the weight's dtype (the epilogue's sum on cuBLASLt, in
//! place), rounding once per chunk, over chunks sized like the input
//! ([`summed_chunk_rows`]). Extra memory: one chunk of logits (at
//! most [`LOGITS_BYTES`]) in the first pass (beside `dW` with `Chunks`),
//! one slice (at most [`SLICE_LOGITS_BYTES`]) beside `dW` in the second. A
//! differentiated mean or sum runs the second pass in the backward pass
//! ([`Pass::WeightGrad`]), where the upstream gradient is known and folds
//! into the logits' gradient.

use burn::tensor::{DType, Int, Tensor, TensorPrimitive};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use bastile_cubecl::cross_entropy::{CrossEntropyMode, VocabSlice};

use crate::backend::matmul::{matmul_blas_into_rows, product};
use crate::fused::cube::{as_rows, contiguous_i32, empty_like, stride_multiple};
use crate::fused::{kernel, kernel_dtype};
use crate::ops::cross_entropy::kernel::{Launch, problem};
use crate::ops::cross_entropy::{LossSpec, WeightGradSum};

type Cube<R, F, I, BT> = CubeBackend<R, F, I, BT>;

/// What a run of the loop computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Pass {
    /// Losses and `lse` only.
    Stats,
    /// Losses, `lse` and the gradients of the scaled loss sum.
    StatsAndGrads,
    /// Losses, `lse` and the gradients of the scaled loss sum for the
    /// input and the bias: [`Pass::StatsAndGrads`] without the weight's,
    /// which [`Pass::WeightGrad`] computes once the upstream gradient is
    /// known.
    StatsAndInputGrads,
    /// Gradients for upstream gradients (`dloss`, after the inputs: `[1]`
    /// or one per token), from the forward's `lse` (before it).
    Grads,
    /// The weight's gradient alone for upstream gradients `dloss`, from
    /// the forward's `lse`: the pass over vocabulary slices, with the
    /// upstream gradient folded into the logits' gradient.
    WeightGrad,
}

impl Pass {
    /// Whether the pass takes the forward's `lse` and the upstream
    /// gradients.
    fn takes_upstream(self) -> bool {
        matches!(self, Pass::Grads | Pass::WeightGrad)
    }

    /// Whether the pass returns the per-token losses and `lse`.
    pub(super) fn returns_stats(self) -> bool {
        matches!(
            self,
            Pass::Stats | Pass::StatsAndGrads | Pass::StatsAndInputGrads
        )
    }

    /// Whether the pass returns the input's (and the bias's) gradient.
    pub(super) fn returns_input_grads(self) -> bool {
        matches!(
            self,
            Pass::StatsAndGrads | Pass::StatsAndInputGrads | Pass::Grads
        )
    }

    /// Whether the pass returns the weight's gradient.
    pub(super) fn returns_weight_grad(self) -> bool {
        matches!(self, Pass::StatsAndGrads | Pass::Grads | Pass::WeightGrad)
    }
}

/// One run of the chunk loop. Inputs: `hidden, weight, bias?` (then `lse,
/// dloss` for the passes that take the upstream gradient), and the labels;
/// outputs, in this order, what the pass returns of: the per-token
/// `losses, lse`, the gradients of `hidden`, `weight` and `bias?`.
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
        let upstream = op.pass.takes_upstream().then(|| {
            let dloss = floats.pop().expect("dloss");
            (floats.pop().expect("lse"), dloss)
        });
        let bias = if op.has_bias { floats.pop() } else { None };
        let weight = floats.pop().expect("weight");
        let hidden = floats.pop().expect("hidden");
        let labels = ints.pop().expect("labels");
        let out = run::<R, F, I, BT>(hidden, weight, bias, labels, &op.spec, op.pass, upstream);
        let stats = out.stats.map(|(losses, lse)| [losses, lse]);
        let grads = [out.hidden, out.weight, out.bias];
        stats
            .into_iter()
            .flatten()
            .chain(grads.into_iter().flatten())
            .collect()
    }
);

/// Bytes of logits the loop holds at a time: a chunk of tokens' rows in
/// the first pass, a slice of the vocabulary's columns for every token in
/// the second (a quarter of Qwen3-0.6B's 1.16 GiB bf16 embedding).
const LOGITS_BYTES: usize = 1 << 28;

/// Tokens per chunk: as many as keep the chunk's logits within
/// [`LOGITS_BYTES`] and half of the largest allocation the runtime makes (a
/// quarter of device memory on CUDA), in multiples of 128 (the products'
/// tiles) from 256 up. Every token in one chunk when they fit: then no
/// second pass recomputes the logits for the weight gradient.
pub(crate) fn chunk_rows(
    tokens: usize,
    vocab: usize,
    elem_size: usize,
    max_allocation: u64,
    requested: Option<usize>,
) -> usize {
    if let Some(c) = requested {
        return c.clamp(1, tokens.max(1));
    }
    let budget = LOGITS_BYTES.min(max_allocation as usize / 2);
    let rows = budget / (vocab * elem_size).max(1);
    let rows = if rows >= 256 { rows / 128 * 128 } else { rows };
    rows.clamp(1, tokens.max(1))
}

/// Whether the chunks' own products give `dW` (else the second pass over
/// vocabulary slices does): one chunk of `chunk` rows covers all
/// `tokens`, or [`WeightGradSum::Chunks`] sums them.
pub(crate) fn chunks_give_weight_grad(spec: &LossSpec, chunk: usize, tokens: usize) -> bool {
    chunk >= tokens || spec.weight_grad_sum == WeightGradSum::Chunks
}

/// The fewest tokens a chunk takes when the chunks' products sum `dW`:
/// a narrower product reads and writes all of `dW` for little work.
const MIN_SUMMED_CHUNK: usize = 256;

/// Tokens per chunk when the chunks' products sum `dW`
/// ([`WeightGradSum::Chunks`]): `dW` is then held beside each chunk's
/// logits during the loop, so the chunk is sized like the loss's input
/// (`tokens × hidden`), as Liger-Kernel sizes it: the next power of two of
/// `tokens / ⌈vocab / hidden⌉` rows, at least [`MIN_SUMMED_CHUNK`], at
/// most [`chunk_rows`]'s. Every token in one chunk when they fit
/// [`chunk_rows`]'s budget, and a requested size, as there.
pub(crate) fn summed_chunk_rows(
    tokens: usize,
    vocab: usize,
    hidden: usize,
    elem_size: usize,
    max_allocation: u64,
    requested: Option<usize>,
) -> usize {
    let most = chunk_rows(tokens, vocab, elem_size, max_allocation, requested);
    if requested.is_some() || most >= tokens {
        return most;
    }
    let chunks_of_input = vocab.div_ceil(hidden.max(1)).max(1);
    tokens
        .div_ceil(chunks_of_input)
        .next_power_of_two()
        .max(MIN_SUMMED_CHUNK)
        .min(most)
}

/// Bytes of logits a vocabulary slice of the second pass holds. Smaller
/// than a chunk: the second pass runs while `dW` (`V × H`) is allocated,
/// and its slices' products stay large (every token times the slice).
const SLICE_LOGITS_BYTES: usize = 1 << 26;

/// Vocabulary columns per slice of the second pass: as many as keep every
/// token's logits of the slice within [`SLICE_LOGITS_BYTES`], or within a
/// requested chunk's (`chunk × vocab` elements, so that small requests
/// take small problems through several slices), in multiples of 64
/// columns (the kernels' widest vectors), at least 64.
pub(crate) fn slice_columns(
    tokens: usize,
    vocab: usize,
    elem_size: usize,
    requested_chunk: Option<usize>,
) -> usize {
    let columns = match requested_chunk {
        Some(chunk) => chunk * vocab / tokens.max(1),
        None => SLICE_LOGITS_BYTES / (tokens * elem_size).max(1),
    };
    (columns / 64 * 64).max(64).min(vocab.max(1))
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

/// `a · b` written in `out_dtype` (the operands' or f32).
fn mm<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    a: Tensor<Cube<R, F, I, BT>, 2>,
    b: Tensor<Cube<R, F, I, BT>, 2>,
    out_dtype: DType,
) -> Tensor<Cube<R, F, I, BT>, 2> {
    float(product::<R, F, I, BT>(
        &prim(a),
        &prim(b),
        1.0,
        out_dtype,
        None,
    ))
}

/// What a run of the chunk loop returns, as its [`Pass`] says.
struct LoopOut<T> {
    /// The per-token `(losses, lse)`.
    stats: Option<(T, T)>,
    hidden: Option<T>,
    weight: Option<T>,
    bias: Option<T>,
}

/// Runs the chunk loop of `pass`.
fn run<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    hidden: CubeTensor<R>,
    weight: CubeTensor<R>,
    bias: Option<CubeTensor<R>>,
    labels: CubeTensor<R>,
    spec: &LossSpec,
    pass: Pass,
    upstream: Option<(CubeTensor<R>, CubeTensor<R>)>,
) -> LoopOut<CubeTensor<R>> {
    let client = hidden.client.clone();
    let dtype = hidden.dtype;
    let h = float::<R, F, I, BT, 2>(hidden);
    let w = float::<R, F, I, BT, 2>(weight);
    let b = bias.map(float::<R, F, I, BT, 1>);
    let [n, _] = h.dims();
    let [vocab, hidden_size] = w.dims();
    let labels: Tensor<Cube<R, F, I, BT>, 1, Int> = Tensor::from_primitive(contiguous_i32(labels));
    let max_allocation = client.properties().memory.max_page_size;
    let chunk = match spec.weight_grad_sum {
        WeightGradSum::Exact => chunk_rows(n, vocab, dtype.size(), max_allocation, spec.chunk_size),
        WeightGradSum::Chunks => summed_chunk_rows(
            n,
            vocab,
            hidden_size,
            dtype.size(),
            max_allocation,
            spec.chunk_size,
        ),
    };
    let mode = match pass {
        Pass::Stats => CrossEntropyMode::Stats,
        Pass::StatsAndGrads | Pass::StatsAndInputGrads => CrossEntropyMode::StatsAndGrad,
        Pass::Grads | Pass::WeightGrad => CrossEntropyMode::Grad,
    };
    let row_inputs = upstream.map(|(lse, dloss)| {
        (
            float::<R, F, I, BT, 1>(burn_cubecl::kernel::into_contiguous(lse)),
            float::<R, F, I, BT, 1>(burn_cubecl::kernel::into_contiguous(dloss)),
        )
    });
    assert_eq!(
        row_inputs.is_some(),
        pass.takes_upstream(),
        "a pass takes lse and dloss exactly when it is given the upstream gradient"
    );
    let kernel_dtype = kernel_dtype(dtype).expect("validated dtype");
    let wt = w.clone().transpose();
    // The logits of `h_rows · Wᵀ (+ b)` for vocabulary rows `v0 .. v0 + cols`.
    let logits_of = |h_rows: Tensor<Cube<R, F, I, BT>, 2>, v0: usize, cols: usize| {
        let mut logits = if cols == vocab {
            mm(h_rows, wt.clone(), dtype)
        } else {
            mm(h_rows, wt.clone().narrow(1, v0, cols), dtype)
        };
        if let Some(b) = &b {
            logits = logits + b.clone().narrow(0, v0, cols).reshape([1, cols]);
        }
        as_rows(prim(logits))
    };
    let chunks_sum_dw = chunks_give_weight_grad(spec, chunk, n);
    let first_pass = pass != Pass::WeightGrad;
    let mut losses = Vec::new();
    let mut lses = Vec::new();
    let mut dh = Vec::new();
    // The chunks' products summed so far, or `None` for the second pass
    // below.
    let mut dw: Option<Tensor<Cube<R, F, I, BT>, 2>> = None;
    // `db` sums in f32 across chunks (a vocabulary of floats).
    let mut db: Option<Tensor<Cube<R, F, I, BT>, 1>> = None;
    // The weight-gradient pass skips the chunks: it is the second pass
    // alone.
    for start in (0..n).step_by(chunk).filter(|_| first_pass) {
        let end = (start + chunk).min(n);
        let rows = end - start;
        let hc = h.clone().narrow(0, start, rows);
        let (logits, logits_rows) = logits_of(hc.clone(), 0, vocab);
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
        if chunks_sum_dw && pass.returns_weight_grad() {
            let summed = dw.take().map(prim);
            dw = Some(float(product::<R, F, I, BT>(
                &prim(dlogits.clone().transpose()),
                &prim(hc),
                1.0,
                dtype,
                summed,
            )));
        }
        if b.is_some() {
            let db_c = dlogits.sum_dim(0).reshape([vocab]).cast(DType::F32);
            db = Some(match db {
                Some(acc) => acc + db_c,
                None => db_c,
            });
        }
    }
    let stats = pass
        .returns_stats()
        .then(|| (prim(Tensor::cat(losses, 0)), prim(Tensor::cat(lses, 0))));
    let (dh, db) = if pass.returns_input_grads() {
        (
            Some(prim(Tensor::cat(dh, 0))),
            db.map(|db| prim(db.cast(dtype))),
        )
    } else {
        (None, None)
    };
    let dw = pass.returns_weight_grad().then(|| {
        if let Some(dw) = dw {
            return dw;
        }
        // `WeightGradSum::Exact` over several chunks: `dW` slice by
        // vocabulary slice, each the product over every token at once
        // (summed in f32 inside the product, rounded once), from its
        // columns' logits computed again and turned into their gradient
        // with the rows' `lse`. Summing the chunks' products rounds the sum
        // to the weight's dtype at every chunk, or would take an f32
        // `V × H` accumulator (4·V·H bytes).
        let (lse, row_scale) = match (&row_inputs, &stats) {
            (Some((lse, dloss)), _) => (prim(lse.clone()), Some(prim(dloss.clone()))),
            (None, Some((_, lse))) => (lse.clone(), None),
            (None, None) => unreachable!("a pass without upstream gradients computes the stats"),
        };
        let labels = labels.clone().into_primitive();
        let unused_losses = empty_like(&lse, [1].into(), DType::F32);
        let columns = slice_columns(n, vocab, dtype.size(), spec.chunk_size);
        let h_prim = prim(h.clone());
        let mut dw = empty_like(&lse, [vocab, hidden_size].into(), dtype);
        for v0 in (0..vocab).step_by(columns) {
            let cols = columns.min(vocab - v0);
            let (logits, logits_rows) = logits_of(h.clone(), v0, cols);
            let mut p = problem(
                n,
                cols,
                kernel_dtype,
                stride_multiple(cols, &[&logits_rows]),
                spec,
            );
            p.slice = Some(VocabSlice { offset: v0, vocab });
            Launch {
                logits: &logits,
                logits_rows: &logits_rows,
                labels: &labels,
                grad: None,
                losses: &unused_losses,
                lse: &lse,
                row_scale: row_scale.as_ref(),
            }
            .run(p, CrossEntropyMode::Grad);
            let dlogits_t = float::<R, F, I, BT, 2>(logits).transpose();
            // `dW`'s rows of the slice are contiguous: the product goes
            // straight there on cuBLASLt, else through a copy.
            if !matmul_blas_into_rows(&prim(dlogits_t.clone()), &h_prim, &dw, v0) {
                let part = mm(dlogits_t, h.clone(), dtype);
                dw = prim(
                    float::<R, F, I, BT, 2>(dw).slice_assign([v0..v0 + cols, 0..hidden_size], part),
                );
            }
        }
        float::<R, F, I, BT, 2>(dw)
    });
    LoopOut {
        stats,
        hidden: dh,
        weight: dw.map(prim),
        bias: db,
    }
}

#[cfg(test)]
mod tests {
    use super::{chunk_rows, slice_columns, summed_chunk_rows};

    const GIB: u64 = 1 << 30;

    #[test]
    fn chunks_hold_a_quarter_gib_of_logits_and_short_inputs_run_whole() {
        let chunk = |tokens, vocab, elem| chunk_rows(tokens, vocab, elem, 20 * GIB, None);
        // Qwen3 (151 936) in bf16: 883 rows fit, 768 in multiples of 128.
        assert_eq!(chunk(4096, 151_936, 2), 768);
        assert_eq!(chunk(131_072, 151_936, 2), 768);
        assert_eq!(chunk(4096, 151_936, 4), 384);
        // Llama 3 (128 256): 1046 fit; GPT-2 (50 257): 2670.
        assert_eq!(chunk(8192, 128_256, 2), 1024);
        assert_eq!(chunk(8192, 50_257, 2), 2560);
        // Fewer tokens than a chunk: one chunk.
        assert_eq!(chunk(700, 151_936, 2), 700);
        assert_eq!(chunk(1, 151_936, 2), 1);
        // A requested size wins; the largest allocation bounds the logits
        // (half of a quarter GiB: 441 rows).
        assert_eq!(chunk_rows(8192, 151_936, 2, 20 * GIB, Some(300)), 300);
        assert_eq!(chunk_rows(100, 151_936, 2, 20 * GIB, Some(300)), 100);
        assert_eq!(chunk_rows(8192, 151_936, 2, GIB / 4, None), 384);
        // A vocabulary too wide for 256 rows is not rounded to 128.
        assert_eq!(chunk_rows(8192, 1 << 20, 2, 20 * GIB, None), 128);
        assert_eq!(chunk_rows(8192, 1 << 21, 2, 20 * GIB, None), 64);
    }

    #[test]
    fn summed_chunks_are_sized_like_the_input_from_256_rows() {
        let chunk =
            |tokens, vocab, hidden| summed_chunk_rows(tokens, vocab, hidden, 2, 20 * GIB, None);
        // Llama 3.2 1B (128 256 × 2048: 63 input-sized chunks): 8192 tokens
        // take 131 rows a chunk, 256 as a power of two; 16 384 take 512;
        // 32 768 take 1024, the most a chunk holds.
        assert_eq!(chunk(8192, 128_256, 2048), 256);
        assert_eq!(chunk(16_384, 128_256, 2048), 512);
        assert_eq!(chunk(32_768, 128_256, 2048), 1024);
        assert_eq!(chunk(131_072, 128_256, 2048), 1024);
        // Qwen3-0.6B (151 936 × 1024: 149 chunks): never above 256 rows
        // up to 32 768 tokens, and never below.
        assert_eq!(chunk(2048, 151_936, 1024), 256);
        assert_eq!(chunk(32_768, 151_936, 1024), 256);
        assert_eq!(chunk(65_536, 151_936, 1024), 512);
        // Tokens that fit one chunk stay whole; a requested size wins.
        assert_eq!(chunk(1024, 128_256, 2048), 1024);
        assert_eq!(chunk(700, 151_936, 1024), 700);
        assert_eq!(
            summed_chunk_rows(8192, 151_936, 1024, 2, 20 * GIB, Some(300)),
            300
        );
    }

    #[test]
    fn vocabulary_slices_hold_a_sixteenth_gib_or_a_requested_chunk_of_logits() {
        let columns = |tokens, vocab, elem| slice_columns(tokens, vocab, elem, None);
        // 4096 bf16 tokens: 8192 columns of 64 MiB; 16 384 tokens: 2048.
        assert_eq!(columns(4096, 151_936, 2), 8192);
        assert_eq!(columns(16_384, 151_936, 2), 2048);
        // Rounded down to 64 columns: 3000 f32 tokens fit 5592.
        assert_eq!(columns(3000, 151_936, 4), 5568);
        // Never wider than the vocabulary, never under 64 columns.
        assert_eq!(columns(10, 100, 2), 100);
        assert_eq!(columns(1 << 30, 151_936, 2), 64);
        assert_eq!(columns(1 << 30, 50, 2), 50);
        assert_eq!(columns(0, 50, 2), 50);
        // A requested chunk of 2 tokens out of 5 over 50 257 columns: 2/5
        // of them (20 102), rounded down to 64.
        assert_eq!(slice_columns(5, 50_257, 2, Some(2)), 20_096);
        assert_eq!(slice_columns(37, 300, 4, Some(16)), 128);
    }
}
