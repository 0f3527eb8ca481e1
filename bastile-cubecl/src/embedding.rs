//! The token embedding's backward pass: `grad[ids[t]] += dout[t]` for
//! every token `t`, into `grad` in place.
//!
//! Tokens that share an id add into the same row, so the adds of one row
//! must not race. A unit per column walking every token in order (Burn's
//! `select_add`) is deterministic but has only `hidden` units, each a
//! chain of `tokens` dependent read-modify-writes: 0.85 ms for
//! Qwen3-0.6B's 2048 tokens on an H100, growing with the tokens whatever
//! the width. Here the vocabulary rows are split into `partitions` classes
//! (`row % partitions`): a unit owns one vector of columns of one class,
//! walks every token in order and adds those whose row it owns. Each row still receives its tokens in token
//! order (the same sums, rounded the same way, as the serial loop), with
//! `partitions` times the units and a chain `partitions` times shorter;
//! a token a unit does not own costs it one cached id read.
//!
//! Each add is done in the gradient's dtype (`g + d`, rounded once per
//! token), as Burn's `select_add` does. Ids outside `0..vocab` add nothing.

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::rows::Rows;
use crate::{FloatDtype, KernelError, launch};

/// Units per cube.
const UNITS: u32 = 256;

/// The most row classes a launch splits the vocabulary into.
const MAX_PARTITIONS: usize = 64;

/// The shape of a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EmbeddingGradProblem {
    pub tokens: usize,
    pub vocab: usize,
    pub hidden: usize,
    pub dtype: FloatDtype,
    /// A number both row strides are a multiple of.
    pub stride_multiple: usize,
}

/// The buffers of a launch.
#[derive(Clone, Debug)]
pub struct EmbeddingGradBuffers {
    /// `vocab` rows of `hidden`: the gradient added into.
    pub grad: Rows,
    /// `tokens` i32 ids.
    pub ids: Handle,
    /// `tokens` rows of `hidden`: the lookup's output gradient.
    pub dout: Rows,
}

/// Row classes for `row_vectors` vectors per row: enough units to fill
/// the device (512 per multiprocessor), at most [`MAX_PARTITIONS`].
fn partitions<R: Runtime>(client: &ComputeClient<R>, row_vectors: usize) -> usize {
    let wanted = launch::parallel_units(client) * 512;
    wanted.div_ceil(row_vectors.max(1)).clamp(1, MAX_PARTITIONS)
}

/// Adds every token's output gradient into its id's row of `grad`.
pub fn add_rows<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &EmbeddingGradProblem,
    buffers: &EmbeddingGradBuffers,
) -> Result<(), KernelError> {
    let p = problem;
    if p.stride_multiple == 0 {
        return Err(KernelError::Shape(
            "embedding gradient strides must be a positive multiple".into(),
        ));
    }
    let v = launch::vector_size(client, p.dtype, launch::gcd(p.hidden, p.stride_multiple));
    buffers
        .grad
        .check("embedding gradient", p.vocab, p.hidden, v, p.dtype)?;
    buffers
        .dout
        .check("embedding output gradient", p.tokens, p.hidden, v, p.dtype)?;
    launch::check_holds("embedding ids", &buffers.ids, p.tokens, 4)?;
    if p.tokens == 0 || p.vocab == 0 || p.hidden == 0 {
        return Ok(());
    }
    let row_vectors = p.hidden / v;
    let partitions = partitions(client, row_vectors);
    let units = row_vectors * partitions;
    unsafe {
        embedding_grad_kernel::launch_unchecked::<R>(
            client,
            launch::cube_count(client, units.div_ceil(UNITS as usize))?,
            CubeDim::new_1d(UNITS),
            v,
            buffers.grad.arg(p.vocab, p.hidden),
            launch::flat_arg(&buffers.ids, p.tokens),
            buffers.dout.arg(p.tokens, p.hidden),
            p.tokens,
            p.vocab,
            row_vectors,
            buffers.grad.stride_vecs(v),
            buffers.dout.stride_vecs(v),
            partitions,
            p.dtype.storage(),
        )
    };
    Ok(())
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn embedding_grad_kernel<F: Float, N: Size>(
    grad: &mut Tensor<Vector<F, N>>,
    ids: &Tensor<i32>,
    dout: &Tensor<Vector<F, N>>,
    tokens: usize,
    vocab: usize,
    row_vectors: usize,
    grad_stride: usize,
    dout_stride: usize,
    partitions: usize,
    #[define(F)] _dtype: StorageType,
) {
    let unit = CUBE_POS * UNITS as usize + UNIT_POS as usize;
    let col = unit % row_vectors;
    let class = unit / row_vectors;
    if class < partitions {
        for t in 0..tokens {
            let id = ids[t];
            if id >= 0 {
                let row = usize::cast_from(id);
                if row < vocab && row % partitions == class {
                    let at = row * grad_stride + col;
                    grad[at] = grad[at] + dout[t * dout_stride + col];
                }
            }
        }
    }
}
