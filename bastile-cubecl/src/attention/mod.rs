//! Fused attention for training: flash-style forward and backward.
//!
//! For each batch entry `b` and query head `h` (key/value head
//! `h / (heads / kv_heads)`: GQA without a materialized repeat):
//!
//! ```text
//! sᵢⱼ   = scale · qᵢ·kⱼ          where key j is allowed for query i, else absent
//! lseᵢ  = log(exp(sink_h) + Σⱼ exp(sᵢⱼ))      (no sink term without sinks)
//! oᵢ    = Σⱼ exp(sᵢⱼ − lseᵢ) · vⱼ
//! ```
//!
//! Key `j` is allowed for query `i` when `j < key_length[b]`, and, with the
//! query at key position `pᵢ = i + seq_k − seq_q` (bottom-right aligned, as
//! Burn's causal mask), `j ≤ pᵢ` when causal and `pᵢ − j < window` with a
//! sliding window; with documents, also `j ≥ doc_start[b, pᵢ]` (rows that
//! pack several documents: each query sees only its own document). A row
//! that sees no key and has no sink outputs zeros.
//!
//! The forward saves only `o` and `lse` (f32); the backward recomputes the
//! scores block by block, so no `[seq, seq]` buffer ever exists. Scores,
//! softmax statistics and every accumulator are f32 whatever the input
//! dtype. Tensors are `[batch, heads, seq, head_dim]` with any batch, head
//! and row strides and a unit-stride head dim.
//!
//! This module is the portable path (shared-memory tiles, f32 FMA on any
//! CubeCL runtime); block sizes are autotuned per (sequence lengths,
//! head dim, dtype, masks). [`mma`] computes the same on tensor cores
//! where the runtime has them.

mod backward;
mod blocks;
#[cfg(feature = "cuda")]
pub mod cudnn;
mod forward;
pub mod mma;
mod tile;

use cubecl::prelude::*;
use cubecl::server::Handle;
use cubecl::tune::{LocalTuner, local_tuner};

pub use blocks::{BlockGradBuffers, BlockSoftmaxBuffers, QueryBlock, block_grad, block_softmax};
pub use tile::AttnTile;

use crate::tune::{CandidateCache, Tuner, run_tuned};
use crate::{FloatDtype, KernelError, launch};

/// One attention problem. Query `[batch, heads, seq_q, head_dim]`, key and
/// value `[batch, kv_heads, seq_k, head_dim]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionProblem {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub seq_q: usize,
    pub seq_k: usize,
    pub head_dim: usize,
    pub scale: f32,
    pub causal: bool,
    /// Keys fewer than this many positions behind the query are visible.
    pub window: Option<usize>,
    /// One extra softmax logit per query head (`sinks`, f32 `[heads]`).
    pub sinks: bool,
    /// Per batch entry, how many keys are real (`key_lengths`, i32
    /// `[batch]`); the rest are padding.
    pub key_lengths: bool,
    /// Rows hold several documents (`doc_starts`, i32 `[batch, seq_k]`:
    /// where the document of each key position starts, never decreasing
    /// along a row and at most the position): a query sees only the keys
    /// of its own document. Needs the causal mask.
    pub documents: bool,
    pub dtype: FloatDtype,
}

impl AttentionProblem {
    fn validate(&self) -> Result<(), KernelError> {
        let dims = [
            self.batch,
            self.heads,
            self.kv_heads,
            self.seq_q,
            self.seq_k,
            self.head_dim,
        ];
        if dims.contains(&0) {
            return Err(KernelError::Shape(format!(
                "attention needs non-empty dimensions, got {self:?}"
            )));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(KernelError::Shape(format!(
                "{} query heads are not a multiple of {} key/value heads",
                self.heads, self.kv_heads
            )));
        }
        if (self.causal || self.window.is_some()) && self.seq_k < self.seq_q {
            return Err(KernelError::Shape(format!(
                "a causal or windowed mask needs at least as many keys ({}) as queries ({})",
                self.seq_k, self.seq_q
            )));
        }
        if self.documents && !self.causal {
            return Err(KernelError::Shape(
                "documents in a row need the causal mask (a query's document ends at the query)"
                    .into(),
            ));
        }
        if self.window == Some(0) {
            return Err(KernelError::Shape(
                "a sliding window must hold at least one position".into(),
            ));
        }
        if !self.scale.is_finite() {
            return Err(KernelError::Shape(format!(
                "the softmax scale must be finite, got {}",
                self.scale
            )));
        }
        Ok(())
    }

    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// The optional inputs the problem names are there and hold what the
    /// kernels read: sinks f32 `[heads]`, key lengths i32 `[batch]`,
    /// document starts i32 `[batch, seq_k]`.
    fn check_masks(
        &self,
        sinks: Option<&Handle>,
        key_lengths: Option<&Handle>,
        doc_starts: Option<&Handle>,
    ) -> Result<(), KernelError> {
        for (what, named, handle, elements) in [
            ("sinks", self.sinks, sinks, self.heads),
            ("key lengths", self.key_lengths, key_lengths, self.batch),
            (
                "document starts",
                self.documents,
                doc_starts,
                self.batch * self.seq_k,
            ),
        ] {
            match handle {
                None if named => {
                    return Err(KernelError::Shape(format!(
                        "the attention problem has {what} but no buffer holds them"
                    )));
                }
                Some(h) if named && h.size_in_used() < 4 * elements as u64 => {
                    return Err(KernelError::Shape(format!(
                        "the attention {what} need {elements} 4-byte values, the buffer holds {} bytes",
                        h.size_in_used()
                    )));
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Query rows over all batch entries and heads (`lse`, `delta` length).
    pub fn query_rows(&self) -> usize {
        self.batch * self.heads * self.seq_q
    }

    fn pitch(&self) -> u32 {
        (self.head_dim + 4 / self.dtype.size()) as u32
    }

    /// The kernels' [`AttnDims`] for cubes that own `blocks` blocks of rows
    /// per (batch, head).
    fn dims_arg<R: Runtime>(&self, blocks: usize) -> AttnDimsLaunch<R> {
        AttnDimsLaunch::new(
            self.batch,
            self.heads,
            self.group(),
            self.seq_q,
            self.seq_k,
            blocks,
            self.window.unwrap_or(0),
            self.scale,
        )
    }
}

/// The problem's scalars as the flash kernels (tiled and tensor-core,
/// forward and backward) take them.
#[derive(CubeType, CubeLaunch, Clone, Copy)]
pub(crate) struct AttnDims {
    pub batch: usize,
    pub heads: usize,
    /// Query heads per key/value head.
    pub group: usize,
    pub seq_q: usize,
    pub seq_k: usize,
    /// Blocks of rows per (batch, head) along the sequence the cubes own
    /// (queries or keys).
    pub blocks: usize,
    /// The sliding window, 0 without one.
    pub window: usize,
    pub scale: f32,
}

/// What the forward kernels read: queries, keys and values (elements `E`:
/// the dtype, or 16-byte vectors of it on the tensor cores), the sinks
/// (f32 `[heads]`), key lengths (i32 `[batch]`) and document starts (i32
/// `[batch, seq_k]`), each a placeholder when the problem has none, and
/// the (batch, head, row) strides of q, k, v and out in units of `E` (see
/// [`tile::Q`] and the rest).
#[derive(CubeType, CubeLaunch)]
pub(crate) struct ForwardInputs<E: CubePrimitive> {
    pub q: Tensor<E>,
    pub k: Tensor<E>,
    pub v: Tensor<E>,
    pub sinks: Tensor<f32>,
    pub key_lengths: Tensor<i32>,
    pub doc_starts: Tensor<i32>,
    pub strides: Sequence<usize>,
}

/// What the backward's dK/dV and dQ kernels read: the forward's inputs,
/// the output gradient, the forward's per-row `lse` and the Δ kernel's
/// per-row `delta` (statistics `S`: f32, or one-element vectors where a
/// kernel copies them asynchronously), the key lengths, the document
/// starts, and the strides of all eight tensors in units of `E`.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct BackwardInputs<E: CubePrimitive, S: CubePrimitive> {
    pub q: Tensor<E>,
    pub k: Tensor<E>,
    pub v: Tensor<E>,
    pub dout: Tensor<E>,
    pub lse: Tensor<S>,
    pub delta: Tensor<S>,
    pub key_lengths: Tensor<i32>,
    pub doc_starts: Tensor<i32>,
    pub strides: Sequence<usize>,
}

/// A `[batch, heads, seq, head_dim]` tensor: its buffer and its batch, head
/// and row strides in elements (the head dim is unit stride).
#[derive(Clone, Debug)]
pub struct HeadLayout {
    pub handle: Handle,
    pub strides: [usize; 3],
}

impl HeadLayout {
    /// A dense `[batch, heads, seq, head_dim]` tensor.
    pub fn dense(handle: Handle, heads: usize, seq: usize, head_dim: usize) -> Self {
        Self {
            handle,
            strides: [heads * seq * head_dim, seq * head_dim, head_dim],
        }
    }

    /// One past the last element of a `[batch, heads, seq, d]` tensor in
    /// this layout (every dimension positive: validated).
    fn extent(&self, [batch, heads, seq, d]: [usize; 4]) -> usize {
        let [sb, sh, ss] = self.strides;
        (batch - 1) * sb + (heads - 1) * sh + (seq - 1) * ss + d
    }

    fn arg<R: Runtime>(&self, dims: [usize; 4]) -> TensorArg<R> {
        flat_arg(&self.handle, self.extent(dims))
    }
}

impl HeadLayout {
    /// The buffer reaches the last element of a `[batch, heads, seq, d]`
    /// tensor of `dtype`.
    fn check(&self, what: &str, dims: [usize; 4], dtype: FloatDtype) -> Result<(), KernelError> {
        let what = format!("attention {what}");
        launch::check_holds(&what, &self.handle, self.extent(dims), dtype.size())
    }

    /// Whether every row starts on a vector of `v` elements of `size`
    /// bytes: strides that are whole vectors and a buffer offset on a
    /// vector boundary.
    fn splits_into(&self, v: usize, size: usize) -> bool {
        self.strides.iter().all(|s| s.is_multiple_of(v))
            && self
                .handle
                .offset_start
                .unwrap_or(0)
                .is_multiple_of((v * size) as u64)
    }
}

/// f16/bf16 tensors whose every row starts on a 16-byte vector (whole
/// vectors of strides, a buffer on a vector boundary), which `reader`
/// (the tensor-core kernels, cuDNN) loads them in.
pub(crate) fn half_rows_in_vectors(
    layouts: &[&HeadLayout],
    reader: &str,
) -> Result<(), KernelError> {
    // Vectors of 8 two-byte elements.
    match layouts.iter().find(|l| !l.splits_into(8, 2)) {
        Some(l) => Err(KernelError::Unsupported(format!(
            "{reader} reads 16-byte vectors: strides {:?} at byte offset {} do not allow them",
            l.strides,
            l.handle.offset_start.unwrap_or(0)
        ))),
        None => Ok(()),
    }
}

fn flat_arg<R: Runtime>(handle: &Handle, len: usize) -> TensorArg<R> {
    unsafe { TensorArg::from_raw_parts(handle.clone(), [1].into(), [len].into()) }
}

/// The forward's buffers. `lse` is f32 `[batch, heads, seq_q]` (dense).
#[derive(Clone, Debug)]
pub struct AttentionForwardBuffers {
    pub q: HeadLayout,
    pub k: HeadLayout,
    pub v: HeadLayout,
    pub out: HeadLayout,
    pub lse: Handle,
    pub sinks: Option<Handle>,
    pub key_lengths: Option<Handle>,
    pub doc_starts: Option<Handle>,
}

/// The backward's buffers: the forward's inputs and results, the output
/// gradient, the three input gradients, an f32 scratch of one value per
/// query row (`delta`) and, with sinks, each query row's share of the sink
/// gradient (`dsink_rows`, f32 `[batch, heads, seq_q]`: the sink gradient
/// is its sum over batch and rows).
#[derive(Clone, Debug)]
pub struct AttentionBackwardBuffers {
    pub q: HeadLayout,
    pub k: HeadLayout,
    pub v: HeadLayout,
    pub out: HeadLayout,
    pub dout: HeadLayout,
    pub lse: Handle,
    pub sinks: Option<Handle>,
    pub key_lengths: Option<Handle>,
    pub doc_starts: Option<Handle>,
    pub dq: HeadLayout,
    pub dk: HeadLayout,
    pub dv: HeadLayout,
    pub delta: Handle,
    pub dsink_rows: Option<Handle>,
}

/// One launch configuration: a cube owns `rows` rows, streams blocks of
/// `cols` rows, and `upr` units share a row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct AttnLaunch {
    pub rows: u32,
    pub cols: u32,
    pub upr: u32,
}

/// Static shared memory stays within what every CUDA kernel may declare
/// without opting in, whatever more the device could give.
const SHARED_LIMIT: usize = 48 * 1024;

impl AttnLaunch {
    fn tile(&self, problem: &AttentionProblem) -> AttnTile {
        AttnTile {
            rows: self.rows,
            cols: self.cols,
            upr: self.upr,
            head_dim: problem.head_dim as u32,
            pitch: problem.pitch(),
            causal: problem.causal,
            window: problem.window.is_some(),
            sinks: problem.sinks,
            key_lengths: problem.key_lengths,
            documents: problem.documents,
        }
    }

    fn units(&self) -> u32 {
        self.rows * self.upr
    }

    /// `upr` units along X share a row; one row per Y (the row reductions
    /// of [`crate::reduce`] take that layout).
    fn cube_dim(&self) -> CubeDim {
        CubeDim::new_2d(self.upr, self.rows)
    }

    /// Shared memory of the forward (`backward == false`) or of the larger
    /// backward kernel.
    fn shared_bytes(&self, problem: &AttentionProblem, backward: bool) -> usize {
        let (rows, cols) = (self.rows as usize, self.cols as usize);
        let tile = problem.pitch() as usize * problem.dtype.size();
        if backward {
            2 * (rows + cols) * tile + 2 * rows * cols * 4
        } else {
            (rows + cols) * tile + rows * cols * 4 + rows * self.upr as usize * 4
        }
    }

    fn check<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        problem: &AttentionProblem,
        backward: bool,
    ) -> Result<AttnTile, KernelError> {
        let d = problem.head_dim as u32;
        if self.upr == 0
            || self.rows == 0
            || !d.is_multiple_of(self.upr)
            || !self.cols.is_multiple_of(self.upr)
        {
            return Err(KernelError::Unsupported(format!(
                "{self:?} does not tile head dim {d}"
            )));
        }
        let shared = self.shared_bytes(problem, backward);
        if shared > SHARED_LIMIT {
            return Err(KernelError::Unsupported(format!(
                "{self:?} needs {shared} bytes of shared memory, over {SHARED_LIMIT}"
            )));
        }
        launch::check_cube_fits(client, self.units(), shared)?;
        Ok(self.tile(problem))
    }
}

fn dummy<R: Runtime>(client: &ComputeClient<R>) -> Handle {
    client.empty(4)
}

/// The batch, head and row strides of `layouts` in order, in units of
/// `unit` elements (1 for element-wise kernels, the vector width for
/// vectorized ones); the kernels index them by position.
fn seq_strides<R: Runtime>(layouts: &[&HeadLayout], unit: usize) -> SequenceArg<R, usize> {
    layouts
        .iter()
        .flat_map(|l| l.strides.map(|s| s / unit))
        .collect()
}

impl AttentionProblem {
    /// A query-side tensor (`[batch, heads, seq_q, head_dim]`) as a kernel
    /// argument.
    fn query_arg<R: Runtime>(&self, layout: &HeadLayout) -> TensorArg<R> {
        layout.arg(self.query_dims())
    }

    /// `[batch, heads, seq_q, head_dim]`.
    fn query_dims(&self) -> [usize; 4] {
        [self.batch, self.heads, self.seq_q, self.head_dim]
    }

    /// `[batch, kv_heads, seq_k, head_dim]`.
    fn key_dims(&self) -> [usize; 4] {
        [self.batch, self.kv_heads, self.seq_k, self.head_dim]
    }

    /// The document starts (`[batch, seq_k]`, a placeholder without
    /// documents) as a kernel argument.
    fn doc_starts_arg<R: Runtime>(&self, starts: &Handle) -> TensorArg<R> {
        flat_arg(
            starts,
            if self.documents {
                self.batch * self.seq_k
            } else {
                1
            },
        )
    }

    /// A key-side tensor (`[batch, kv_heads, seq_k, head_dim]`) as a kernel
    /// argument.
    fn key_arg<R: Runtime>(&self, layout: &HeadLayout) -> TensorArg<R> {
        layout.arg(self.key_dims())
    }
}

impl AttentionForwardBuffers {
    /// Each buffer holds what the forward reads and writes, and the
    /// problem's sinks, key lengths and document starts are here.
    fn check(&self, p: &AttentionProblem) -> Result<(), KernelError> {
        let (queries, keys) = (p.query_dims(), p.key_dims());
        self.q.check("query", queries, p.dtype)?;
        self.k.check("key", keys, p.dtype)?;
        self.v.check("value", keys, p.dtype)?;
        self.out.check("output", queries, p.dtype)?;
        launch::check_holds("attention lse", &self.lse, p.query_rows(), 4)?;
        p.check_masks(
            self.sinks.as_ref(),
            self.key_lengths.as_ref(),
            self.doc_starts.as_ref(),
        )
    }

    /// q, k, v, out: the order the kernels read their strides in
    /// ([`tile::Q`] ..).
    fn layouts(&self) -> [&HeadLayout; 4] {
        [&self.q, &self.k, &self.v, &self.out]
    }

    /// The forward kernels' inputs, strides in units of `unit` elements.
    fn inputs<R: Runtime, E: CubePrimitive>(
        &self,
        client: &ComputeClient<R>,
        p: &AttentionProblem,
        unit: usize,
    ) -> ForwardInputsLaunch<E, R> {
        let sinks = self.sinks.clone().unwrap_or_else(|| dummy(client));
        let lengths = self.key_lengths.clone().unwrap_or_else(|| dummy(client));
        let starts = self.doc_starts.clone().unwrap_or_else(|| dummy(client));
        ForwardInputsLaunch::new(
            p.query_arg(&self.q),
            p.key_arg(&self.k),
            p.key_arg(&self.v),
            flat_arg(&sinks, p.heads),
            flat_arg(&lengths, p.batch),
            p.doc_starts_arg(&starts),
            seq_strides(&self.layouts(), unit),
        )
    }
}

impl AttentionBackwardBuffers {
    /// Each buffer holds what the backward reads and writes (only the Δ
    /// kernel's with `delta_only`), and the problem's sinks, key lengths
    /// and document starts are here.
    fn check(&self, p: &AttentionProblem, delta_only: bool) -> Result<(), KernelError> {
        let (queries, keys) = (p.query_dims(), p.key_dims());
        self.out.check("output", queries, p.dtype)?;
        self.dout.check("output gradient", queries, p.dtype)?;
        let rows = p.query_rows();
        launch::check_holds("attention lse", &self.lse, rows, 4)?;
        launch::check_holds("attention delta", &self.delta, rows, 4)?;
        match &self.dsink_rows {
            Some(h) => launch::check_holds("attention sink gradient rows", h, rows, 4)?,
            None if p.sinks => {
                return Err(KernelError::Shape(
                    "the attention problem has sinks but no buffer for their gradient".into(),
                ));
            }
            None => {}
        }
        if delta_only {
            // The Δ kernel reads only the sinks.
            let sinks_only = AttentionProblem {
                key_lengths: false,
                documents: false,
                ..*p
            };
            return sinks_only.check_masks(self.sinks.as_ref(), None, None);
        }
        self.q.check("query", queries, p.dtype)?;
        self.k.check("key", keys, p.dtype)?;
        self.v.check("value", keys, p.dtype)?;
        self.dq.check("query gradient", queries, p.dtype)?;
        self.dk.check("key gradient", keys, p.dtype)?;
        self.dv.check("value gradient", keys, p.dtype)?;
        p.check_masks(
            self.sinks.as_ref(),
            self.key_lengths.as_ref(),
            self.doc_starts.as_ref(),
        )
    }

    /// q, k, v, out, dout, dq, dk, dv: the order the kernels read their
    /// strides in ([`tile::Q`] ..).
    fn layouts(&self) -> [&HeadLayout; 8] {
        [
            &self.q, &self.k, &self.v, &self.out, &self.dout, &self.dq, &self.dk, &self.dv,
        ]
    }

    /// The dK/dV and dQ kernels' inputs, strides in units of `unit`
    /// elements.
    fn inputs<R: Runtime, E: CubePrimitive, S: CubePrimitive>(
        &self,
        client: &ComputeClient<R>,
        p: &AttentionProblem,
        unit: usize,
    ) -> BackwardInputsLaunch<E, S, R> {
        let lengths = self.key_lengths.clone().unwrap_or_else(|| dummy(client));
        let starts = self.doc_starts.clone().unwrap_or_else(|| dummy(client));
        BackwardInputsLaunch::new(
            p.query_arg(&self.q),
            p.key_arg(&self.k),
            p.key_arg(&self.v),
            p.query_arg(&self.dout),
            flat_arg(&self.lse, p.query_rows()),
            flat_arg(&self.delta, p.query_rows()),
            flat_arg(&lengths, p.batch),
            p.doc_starts_arg(&starts),
            seq_strides(&self.layouts(), unit),
        )
    }
}

/// Launches the forward with one explicit configuration.
pub fn forward_with<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &AttentionProblem,
    buffers: &AttentionForwardBuffers,
    config: &AttnLaunch,
) -> Result<(), KernelError> {
    problem.validate()?;
    buffers.check(problem)?;
    let t = config.check(client, problem, false)?;
    let p = problem;
    let q_blocks = p.seq_q.div_ceil(config.rows as usize);
    let count = launch::cube_count(client, p.batch * p.heads * q_blocks)?;
    let b = &buffers;
    let cube_dim = config.cube_dim();
    let inputs = b.inputs(client, p, 1);
    let out = p.query_arg(&b.out);
    let lse = flat_arg(&b.lse, p.query_rows());
    let dims = p.dims_arg::<R>(q_blocks);
    let dtype = p.dtype.storage();
    unsafe {
        forward::attention_forward_kernel::launch_unchecked::<R>(
            client, count, cube_dim, inputs, out, lse, dims, t, dtype,
        )
    }
    Ok(())
}

/// Launches the backward (delta, dK/dV, dQ) with one explicit
/// configuration: the dQ kernel owns `rows` query rows and streams `cols`
/// keys; the dK/dV kernel owns `rows` key rows and streams `cols` queries.
pub fn backward_with<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &AttentionProblem,
    buffers: &AttentionBackwardBuffers,
    config: &AttnLaunch,
) -> Result<(), KernelError> {
    problem.validate()?;
    buffers.check(problem, false)?;
    let t = config.check(client, problem, true)?;
    let p = problem;
    let b = &buffers;
    launch_delta(client, p, b, config, t, None)?;
    let cube_dim = config.cube_dim();
    let dtype = p.dtype.storage();
    let k_blocks = p.seq_k.div_ceil(config.rows as usize);
    let k_count = launch::cube_count(client, p.batch * p.kv_heads * k_blocks)?;
    let q_blocks = p.seq_q.div_ceil(config.rows as usize);
    let q_count = launch::cube_count(client, p.batch * p.heads * q_blocks)?;
    let (dk, dv, dq) = (p.key_arg(&b.dk), p.key_arg(&b.dv), p.query_arg(&b.dq));
    unsafe {
        let inputs = b.inputs(client, p, 1);
        let dims = p.dims_arg::<R>(k_blocks);
        backward::attention_dkdv_kernel::launch_unchecked::<R>(
            client, k_count, cube_dim, inputs, dk, dv, dims, t, dtype,
        );
        let inputs = b.inputs(client, p, 1);
        let dims = p.dims_arg::<R>(q_blocks);
        backward::attention_dq_kernel::launch_unchecked::<R>(
            client, q_count, cube_dim, inputs, dq, dims, t, dtype,
        );
    }
    Ok(())
}

/// Launches only the backward's first kernel: `delta` (`Σ_d dO·O` per
/// query row, f32 `[batch, heads, seq_q]`) and, with sinks, `dsink_rows`
/// (each row's share of the sink gradient). The matrix-product path needs
/// these before its first block.
pub fn backward_delta<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &AttentionProblem,
    buffers: &AttentionBackwardBuffers,
) -> Result<(), KernelError> {
    backward_delta_zeroing(client, problem, buffers, None)
}

/// [`backward_delta`], also zeroing `zeroed` (a dense f32
/// `[batch, heads, seq_q, head_dim]` buffer) when given.
pub(crate) fn backward_delta_zeroing<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &AttentionProblem,
    buffers: &AttentionBackwardBuffers,
    zeroed: Option<&Handle>,
) -> Result<(), KernelError> {
    problem.validate()?;
    buffers.check(problem, true)?;
    // 64 rows per cube, two units per row: the tile's shape only sets the
    // cube's rows and size. Four planes per cube keep a full complement of
    // planes resident on GPUs that hold 32 cubes per multiprocessor.
    let config = AttnLaunch {
        rows: 64,
        cols: 1,
        upr: 2,
    };
    launch_delta(
        client,
        problem,
        buffers,
        &config,
        config.tile(problem),
        zeroed,
    )
}

fn launch_delta<R: Runtime>(
    client: &ComputeClient<R>,
    p: &AttentionProblem,
    b: &AttentionBackwardBuffers,
    config: &AttnLaunch,
    t: AttnTile,
    zeroed: Option<&Handle>,
) -> Result<(), KernelError> {
    let rows = p.query_rows();
    // The widest vector every row of `out` and `dO` splits into.
    let size = p.dtype.size();
    let vec = client
        .io_optimized_vector_sizes(size)
        .filter(|&v| {
            v > 0
                && v * size <= 16
                && p.head_dim.is_multiple_of(v)
                && [&b.out, &b.dout].iter().all(|l| l.splits_into(v, size))
        })
        .max()
        .unwrap_or(1);
    let strides = seq_strides(&b.layouts(), vec);
    let sinks = b.sinks.clone().unwrap_or_else(|| dummy(client));
    let dsink_rows = b.dsink_rows.clone().unwrap_or_else(|| dummy(client));
    let zero_rows = zeroed.is_some();
    let zeroed_len = rows * p.head_dim;
    let zeroed = zeroed.cloned().unwrap_or_else(|| client.empty(4 * vec));
    unsafe {
        backward::attention_delta_kernel::launch_unchecked::<R>(
            client,
            launch::cube_count(client, rows.div_ceil(t.rows as usize))?,
            CubeDim::new_1d(config.units()),
            vec,
            p.query_arg(&b.out),
            p.query_arg(&b.dout),
            flat_arg(&b.lse, rows),
            flat_arg(&sinks, p.heads),
            flat_arg(&b.delta, rows),
            flat_arg(&dsink_rows, if p.sinks { rows } else { 1 }),
            flat_arg(&zeroed, if zero_rows { zeroed_len } else { vec }),
            strides,
            p.heads,
            p.seq_q,
            rows,
            p.head_dim / vec,
            zero_rows,
            t,
            p.dtype.storage(),
        );
    }
    Ok(())
}

/// Every configuration that fits `problem` on this device, for the forward
/// or the backward.
pub fn candidates<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &AttentionProblem,
    backward: bool,
) -> Vec<AttnLaunch> {
    // Square blocks of 8 rows keep wide f32 heads within small shared
    // memories (software Vulkan drivers offer 32 KiB); the larger ones are
    // for GPUs.
    const SHAPES: [(u32, u32, u32); 8] = [
        (8, 8, 4),
        (16, 16, 4),
        (16, 16, 8),
        (32, 32, 4),
        (32, 32, 8),
        (64, 32, 4),
        (32, 64, 8),
        (64, 64, 4),
    ];
    SHAPES
        .into_iter()
        .map(|(rows, cols, upr)| AttnLaunch { rows, cols, upr })
        .filter(|c| c.check(client, problem, backward).is_ok())
        .collect()
}

/// Whether the kernels take `problem` on this client: a valid problem, a
/// dtype the device computes with, and a launch configuration that fits
/// in each direction.
pub fn supported<R: Runtime>(client: &ComputeClient<R>, problem: &AttentionProblem) -> bool {
    problem.validate().is_ok()
        && client.properties().supports_type(problem.dtype.storage())
        && !candidates(client, problem, false).is_empty()
        && !candidates(client, problem, true).is_empty()
}

/// The autotune key: what the best block shape depends on.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct AttnKey {
    pub seq_q: usize,
    pub seq_k: usize,
    pub head_dim: usize,
    pub dtype: FloatDtype,
    pub causal: bool,
    pub window: bool,
    pub documents: bool,
    pub backward: bool,
}

impl core::fmt::Display for AttnKey {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(
            f,
            "attention{} q~{} k~{} d={} {}{}{}{}",
            if self.backward { "_bwd" } else { "_fwd" },
            self.seq_q,
            self.seq_k,
            self.head_dim,
            self.dtype,
            if self.causal { " causal" } else { "" },
            if self.window { " window" } else { "" },
            if self.documents { " documents" } else { "" },
        )
    }
}

fn key(problem: &AttentionProblem, backward: bool) -> AttnKey {
    AttnKey {
        seq_q: problem.seq_q.next_power_of_two(),
        seq_k: problem.seq_k.next_power_of_two(),
        head_dim: problem.head_dim,
        dtype: problem.dtype,
        causal: problem.causal,
        window: problem.window.is_some(),
        documents: problem.documents,
        backward,
    }
}

static FORWARD_TUNER: Tuner<AttnKey> = local_tuner!("bastile-attention-forward");
static BACKWARD_TUNER: Tuner<AttnKey> = local_tuner!("bastile-attention-backward");
/// Candidate lists per device, head dim, dtype and direction.
static CANDIDATES: CandidateCache<(usize, FloatDtype, bool), AttnLaunch> = CandidateCache::new();

/// Forgets every tuning decision taken in this process.
pub fn clear_autotune() {
    FORWARD_TUNER.clear();
    BACKWARD_TUNER.clear();
}

fn tuned_candidates<R: Runtime>(
    client: &ComputeClient<R>,
    device: &R::Device,
    problem: &AttentionProblem,
    backward: bool,
) -> (cubecl::CubeTuneId, AttnKey, std::sync::Arc<Vec<AttnLaunch>>) {
    let id = cubecl::CubeTuneId::new(client, device);
    let key = key(problem, backward);
    let class = (problem.head_dim, problem.dtype, backward);
    let list = CANDIDATES.get(&id, class, || candidates(client, problem, backward));
    (id, key, list)
}

/// Runs the forward with the autotuned configuration.
pub fn forward<R: Runtime>(
    client: &ComputeClient<R>,
    device: &R::Device,
    problem: &AttentionProblem,
    buffers: &AttentionForwardBuffers,
) -> Result<(), KernelError> {
    problem.validate()?;
    buffers.check(problem)?;
    let (id, key, list) = tuned_candidates(client, device, problem, false);
    run_tuned(
        &FORWARD_TUNER,
        key,
        forward_with::<R>,
        client,
        &id,
        problem,
        buffers,
        list,
    )
}

/// Runs the backward with the autotuned configuration.
pub fn backward<R: Runtime>(
    client: &ComputeClient<R>,
    device: &R::Device,
    problem: &AttentionProblem,
    buffers: &AttentionBackwardBuffers,
) -> Result<(), KernelError> {
    problem.validate()?;
    buffers.check(problem, false)?;
    let (id, key, list) = tuned_candidates(client, device, problem, true);
    run_tuned(
        &BACKWARD_TUNER,
        key,
        backward_with::<R>,
        client,
        &id,
        problem,
        buffers,
        list,
    )
}
