//! The f32 accumulator of the fused backward's dQ, once the fused kernel
//! has added every key block's `dS·K` into it (the Δ kernel zeroes it
//! first): scaled and rounded into dQ (whatever its strides), one 16-byte
//! vector of dQ (8 elements) per unit.

use cubecl::prelude::*;

/// `dq = scale · acc`, rounded to the input dtype: vector `i` of the dense
/// `[batch, heads, seq_q, d]` accumulator goes to the same place of dQ
/// (batch, head and row strides `s_b`, `s_h`, `s_q`, in vectors).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn round_dq_kernel<F: Float, N: Size>(
    acc: &Tensor<Vector<f32, N>>,
    dq: &mut Tensor<Vector<F, N>>,
    s_b: usize,
    s_h: usize,
    s_q: usize,
    heads: usize,
    seq_q: usize,
    count: usize,
    scale: f32,
    #[comptime] vecs: usize,
    #[define(F)] _dtype: StorageType,
) {
    let i = CUBE_POS * CUBE_DIM as usize + UNIT_POS as usize;
    if i < count {
        let row = i / vecs;
        let c = i % vecs;
        let q = row % seq_q;
        let bh = row / seq_q;
        let at = (bh / heads) * s_b + (bh % heads) * s_h + q * s_q + c;
        dq[at] = Vector::<F, N>::cast_from(acc[i] * Vector::<f32, N>::new(scale));
    }
}
