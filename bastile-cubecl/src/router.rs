//! A mixture of experts' router choice: for every token row of router
//! logits, the `k` largest logits (ties to the lower expert index; NaN
//! ranks above every number, as `torch.topk` ranks it) and the softmax over
//! those `k`, the weights GPT-OSS and Mixtral give the chosen experts.
//!
//! Burn sorts on the host: its `topk` reads the logits back, which stalls
//! the device queue once per layer. Here one unit owns one row and picks
//! its `k` experts one after another, each the largest that ranks below the
//! previous pick (`k · experts` comparisons, no scratch memory: routers
//! have tens to hundreds of experts), then writes the weights, computed in
//! f32 and rounded once to the logits' dtype.

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::rows::{Rows, tensor_arg};
use crate::{FloatDtype, KernelError, launch};

/// Units per cube.
const UNITS: u32 = 128;

/// The shape of a launch: `rows` rows of `experts` logits, `k` chosen per
/// row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TopKProblem {
    pub rows: usize,
    pub experts: usize,
    pub k: usize,
    pub dtype: FloatDtype,
}

/// The buffers of a launch.
#[derive(Clone, Debug)]
pub struct TopKBuffers {
    /// `rows` rows of `experts` logits.
    pub logits: Rows,
    /// Dense `rows × k`, the logits' dtype: the softmax over the chosen
    /// logits, in the order chosen (largest first).
    pub weights: Handle,
    /// Dense `rows × k` i32: the chosen experts.
    pub indices: Handle,
}

/// Writes every row's `k` largest logits' experts and their softmax.
pub fn top_k_softmax<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &TopKProblem,
    buffers: &TopKBuffers,
) -> Result<(), KernelError> {
    let p = problem;
    if p.k == 0 || p.k > p.experts {
        return Err(KernelError::Shape(format!(
            "a top-k choice takes 1 <= k <= experts, got k {} of {} experts",
            p.k, p.experts
        )));
    }
    launch::check_i32("experts", p.experts)?;
    buffers
        .logits
        .check("router logits", p.rows, p.experts, 1, p.dtype)?;
    launch::check_holds(
        "router weights",
        &buffers.weights,
        p.rows * p.k,
        p.dtype.size(),
    )?;
    launch::check_holds("router indices", &buffers.indices, p.rows * p.k, 4)?;
    if p.rows == 0 {
        return Ok(());
    }
    unsafe {
        top_k_softmax_kernel::launch_unchecked::<R>(
            client,
            launch::cube_count(client, p.rows.div_ceil(UNITS as usize))?,
            CubeDim::new_1d(UNITS),
            buffers.logits.arg(p.rows, p.experts),
            tensor_arg(&buffers.weights, p.rows, p.k),
            TensorArg::from_raw_parts(
                buffers.indices.clone(),
                [p.k, 1].into(),
                [p.rows, p.k].into(),
            ),
            p.rows,
            p.experts,
            p.k,
            buffers.logits.stride,
            p.dtype.storage(),
        )
    };
    Ok(())
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn top_k_softmax_kernel<F: Float>(
    logits: &Tensor<F>,
    weights: &mut Tensor<F>,
    indices: &mut Tensor<i32>,
    rows: usize,
    experts: usize,
    k: usize,
    stride: usize,
    #[define(F)] _dtype: StorageType,
) {
    let row = CUBE_POS * UNITS as usize + UNIT_POS as usize;
    if row < rows {
        let base = row * stride;
        let out = row * k;
        // The previous pick; the next one ranks just below it. The order:
        // NaN first, then larger values, then lower indices.
        // `experts` stands for no pick.
        let mut prev_value = 0.0f32;
        let mut prev_nan = false;
        let mut prev_index = experts;
        let mut top = 0.0f32;
        for j in 0..k {
            let mut best_value = 0.0f32;
            let mut best_nan = false;
            let mut best_index = experts;
            for e in 0..experts {
                let value = f32::cast_from(logits[base + e]);
                let nan = value.is_nan();
                let mut after_prev = true;
                if prev_index < experts {
                    if prev_nan {
                        after_prev = !nan || e > prev_index;
                    } else {
                        after_prev =
                            !nan && (value < prev_value || (value == prev_value && e > prev_index));
                    }
                }
                // Experts come in index order: an equal value keeps the
                // lower index already held.
                let mut beats = true;
                if best_index < experts {
                    beats = !best_nan && (nan || value > best_value);
                }
                if after_prev && beats {
                    best_value = value;
                    best_nan = nan;
                    best_index = e;
                }
            }
            if j == 0 {
                top = best_value;
            }
            weights[out + j] = F::cast_from(best_value);
            indices[out + j] = i32::cast_from(best_index);
            prev_value = best_value;
            prev_nan = best_nan;
            prev_index = best_index;
        }
        // The softmax over the chosen values, whose largest is the first
        // (the raw values are exact in the weights' dtype: they were read
        // from it).
        let mut sum = 0.0f32;
        for j in 0..k {
            sum += (f32::cast_from(weights[out + j]) - top).exp();
        }
        for j in 0..k {
            let value = f32::cast_from(weights[out + j]);
            weights[out + j] = F::cast_from((value - top).exp() / sum);
        }
    }
}
