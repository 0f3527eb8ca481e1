//! Rotary position embedding: the checked public entry points, the
//! composite reference and the fused op's declaration; its autodiff nodes
//! in `autodiff.rs`, its kernel launch in `kernel.rs`.
//!
//! Semantics (HF transformers `apply_rotary_pos_emb`): `x·cos +
//! rotate_half(x)·sin` with the tables cast to the input dtype, computed in
//! the input dtype. The backward pass is the rotation by `−θ`. q and k are
//! rotated in one launch (GQA: different head counts). Tables come from
//! [`RopeTables`] (see [`crate::nn::RotaryEncoding`] for building them from
//! a model config).

mod autodiff;
mod kernel;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Int, Tensor, TensorMetadata};

pub use bastile_cubecl::rope::RopePairing;

use crate::fused::{DTypeQuery, In, KernelBackend, Out, TensorSpec, fused_op};
use crate::ops::{check_float, check_same_device, float};
use crate::patches::Op;
use crate::{BastileBackend, BastileError};

/// How q and k are laid out.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
pub enum RopeLayout {
    /// `[batch, heads, seq, head_dim]` (HF attention after the transpose).
    #[default]
    Bhsd,
    /// `[batch, seq, heads, head_dim]` (straight out of the projections).
    Bshd,
}

impl RopeLayout {
    /// `(batch, heads, seq, head_dim)` of a tensor in this layout.
    pub fn dims(&self, shape: [usize; 4]) -> (usize, usize, usize, usize) {
        match self {
            RopeLayout::Bhsd => (shape[0], shape[1], shape[2], shape[3]),
            RopeLayout::Bshd => (shape[0], shape[2], shape[1], shape[3]),
        }
    }

    /// The dimension index of the heads and of the sequence.
    pub fn head_seq_axes(&self) -> (usize, usize) {
        match self {
            RopeLayout::Bhsd => (1, 2),
            RopeLayout::Bshd => (2, 1),
        }
    }
}

/// What a RoPE call does besides its tensors.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RopeOptions {
    pub layout: RopeLayout,
    pub pairing: RopePairing,
    /// Table row of sequence position 0 (ignored rows before it).
    pub offset: usize,
    /// Rotate by `−θ` (the backward pass).
    pub inverse: bool,
}

/// Precomputed `cos` / `sin` tables, f32, `[tables, positions, head_dim/2]`
/// where `tables` is 1 (shared by the batch) or the batch size (one per
/// sequence, from explicit position ids). HF's attention scaling is
/// already folded in.
#[derive(Clone, Debug)]
pub struct RopeTables<B: Backend> {
    pub cos: Tensor<B, 3>,
    pub sin: Tensor<B, 3>,
}

impl<B: Backend> RopeTables<B> {
    /// Tables for positions `0..positions` from the inverse frequencies
    /// (`head_dim/2` of them), computed on the device in f32 as HF does
    /// (`position · inv_freq`, then `cos`/`sin` times `scaling`).
    pub fn new(positions: usize, inv_freq: &[f32], scaling: f32, device: &B::Device) -> Self {
        // Built from host f32 data: an arange in the backend's default
        // float dtype (possibly bf16) would round large positions.
        let pos = Tensor::<B, 2>::from_data(
            burn::tensor::TensorData::new(
                (0..positions).map(|p| p as f32).collect::<Vec<_>>(),
                [1, positions],
            ),
            (device, DType::F32),
        );
        Self::of_positions(pos, inv_freq, scaling)
    }

    /// One table per sequence for explicit `position_ids` (`[batch, seq]`,
    /// e.g. packed documents restarting at 0), computed from the ids as
    /// [`RopeTables::new`] computes its positions (HF's per-sequence
    /// rotary embedding), with no table to index and nothing read back.
    pub fn for_positions(position_ids: Tensor<B, 2, Int>, inv_freq: &[f32], scaling: f32) -> Self {
        let pos = position_ids.cast(burn::tensor::FloatDType::F32);
        Self::of_positions(pos, inv_freq, scaling)
    }

    /// Tables `[tables, positions, half]` for f32 positions
    /// `[tables, positions]`.
    fn of_positions(pos: Tensor<B, 2>, inv_freq: &[f32], scaling: f32) -> Self {
        let half = inv_freq.len();
        let freq = Tensor::<B, 1>::from_data(
            burn::tensor::TensorData::new(inv_freq.to_vec(), [half]),
            (&pos.device(), DType::F32),
        )
        .reshape([1, 1, half]);
        let angles = pos.unsqueeze_dim::<3>(2) * freq;
        Self {
            cos: angles.clone().cos() * scaling,
            sin: angles.sin() * scaling,
        }
    }

    /// Number of positions the tables cover.
    pub fn positions(&self) -> usize {
        self.cos.dims()[1]
    }

    /// `head_dim / 2`.
    pub fn half(&self) -> usize {
        self.cos.dims()[2]
    }

    /// One table per sequence, gathered from explicit `position_ids`
    /// (`[batch, seq]`, e.g. packed sequences restarting at 0).
    ///
    /// Errors when a position is out of the table's range.
    pub fn gather(&self, position_ids: Tensor<B, 2, Int>) -> Result<Self, BastileError> {
        let [batch, seq] = position_ids.dims();
        let positions = self.positions();
        let ids = position_ids.reshape([batch * seq]);
        if batch * seq > 0 {
            // One device read for both bounds.
            let bounds = Tensor::cat(vec![ids.clone().min(), ids.clone().max()], 0)
                .into_data()
                .convert::<i64>()
                .to_vec::<i64>()
                .expect("i64 data");
            let (min, max) = (bounds[0], bounds[1]);
            if min < 0 || max >= positions as i64 {
                return Err(BastileError::Shape(format!(
                    "position ids span {min}..={max} but the RoPE tables cover 0..{positions}"
                )));
            }
        }
        let take = |t: &Tensor<B, 3>| {
            t.clone()
                .reshape([positions, self.half()])
                .select(0, ids.clone())
                .reshape([batch, seq, self.half()])
        };
        Ok(Self {
            cos: take(&self.cos),
            sin: take(&self.sin),
        })
    }
}

/// Rotates q `[.., q_heads, ..]` and k `[.., k_heads, ..]` (layout per
/// `options`) by the angles of positions `offset..offset + seq`.
///
/// Errors when q and k disagree on batch, sequence or head_dim, when
/// head_dim does not match the tables, when the positions exceed the
/// tables, on per-sequence tables of the wrong batch, or on dtype/device
/// mismatches.
///
/// # Shapes
///
/// - `q`: `[batch, q_heads, seq, head_dim]` (`RopeLayout::Bhsd`) or `[batch, seq, q_heads, head_dim]` (`RopeLayout::Bshd`)
/// - `k`: the same with `k_heads`
/// - output: `(q, k)`, rotated, in the shapes given
pub fn rope<B: BastileBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    tables: &RopeTables<B>,
    options: RopeOptions,
) -> Result<(Tensor<B, 4>, Tensor<B, 4>), BastileError> {
    check(&q, Some(&k), tables, &options)?;
    let input = (
        q.into_primitive().tensor(),
        Some(k.into_primitive().tensor()),
        tables.cos.clone().into_primitive().tensor(),
        tables.sin.clone().into_primitive().tensor(),
    );
    let (q, k) = B::run(&Rope { options }, input);
    Ok((float(q), float(k.expect("k in, k out"))))
}

/// Rotates one tensor (see [`rope`]).
///
/// # Shapes
///
/// - `x`: `[batch, heads, seq, head_dim]` or `[batch, seq, heads, head_dim]`, per `options.layout`
/// - output: the shape of `x`
pub fn rope_one<B: BastileBackend>(
    x: Tensor<B, 4>,
    tables: &RopeTables<B>,
    options: RopeOptions,
) -> Result<Tensor<B, 4>, BastileError> {
    check(&x, None, tables, &options)?;
    let input = (
        x.into_primitive().tensor(),
        None,
        tables.cos.clone().into_primitive().tensor(),
        tables.sin.clone().into_primitive().tensor(),
    );
    let (x, _) = B::run(&Rope { options }, input);
    Ok(float(x))
}

fn check<B: Backend>(
    q: &Tensor<B, 4>,
    k: Option<&Tensor<B, 4>>,
    tables: &RopeTables<B>,
    options: &RopeOptions,
) -> Result<(), BastileError> {
    check_float("RoPE q", q.dtype())?;
    let (b, _, s, d) = options.layout.dims(q.dims());
    if let Some(k) = k {
        let (kb, _, ks, kd) = options.layout.dims(k.dims());
        if (kb, ks, kd) != (b, s, d) {
            return Err(BastileError::Shape(format!(
                "RoPE q {:?} and k {:?} disagree on batch, sequence or head_dim ({:?} layout)",
                q.dims(),
                k.dims(),
                options.layout
            )));
        }
        if k.dtype() != q.dtype() {
            return Err(BastileError::DType(format!(
                "RoPE q is {:?} but k is {:?}",
                q.dtype(),
                k.dtype()
            )));
        }
        check_same_device("RoPE q", &q.device(), "k", &k.device())?;
    }
    let [tb, positions, half] = tables.cos.dims();
    if tables.sin.dims() != [tb, positions, half] {
        return Err(BastileError::Shape(format!(
            "RoPE cos table {:?} and sin table {:?} differ",
            tables.cos.dims(),
            tables.sin.dims()
        )));
    }
    if d != 2 * half {
        return Err(BastileError::Shape(format!(
            "RoPE head_dim is {d} but the tables are for head_dim {}",
            2 * half
        )));
    }
    if tb != 1 && tb != b {
        return Err(BastileError::Shape(format!(
            "RoPE has {tb} per-sequence tables for a batch of {b}"
        )));
    }
    if options.offset + s > positions {
        return Err(BastileError::Shape(format!(
            "RoPE positions {}..{} exceed the {positions} positions of the tables",
            options.offset,
            options.offset + s
        )));
    }
    if tables.cos.dtype() != DType::F32 || tables.sin.dtype() != DType::F32 {
        return Err(BastileError::DType(format!(
            "RoPE tables must be f32, got {:?}",
            tables.cos.dtype()
        )));
    }
    check_same_device("RoPE input", &q.device(), "tables", &tables.cos.device())
}

/// Full-width table rows for the sequence, in the input dtype, shaped to
/// broadcast against the input.
fn full_table<B: Backend>(
    table: FloatTensor<B>,
    seq: usize,
    dtype: DType,
    options: &RopeOptions,
) -> Tensor<B, 4> {
    let t = float::<B, 3>(table);
    let [tb, _, half] = t.dims();
    let rows = t
        .slice([0..tb, options.offset..options.offset + seq, 0..half])
        .cast(dtype);
    let full = match options.pairing {
        RopePairing::Half => Tensor::cat(vec![rows.clone(), rows], 2),
        RopePairing::Interleaved => {
            let r = rows.reshape([tb, seq, half, 1]);
            Tensor::cat(vec![r.clone(), r], 3).reshape([tb, seq, 2 * half])
        }
    };
    match options.layout {
        RopeLayout::Bhsd => full.unsqueeze_dim(1),
        RopeLayout::Bshd => full.unsqueeze_dim(2),
    }
}

/// `rotate_half` (or its interleaved counterpart): the partner of every
/// element, negated for the first of each pair.
fn rotate<B: Backend>(x: Tensor<B, 4>, pairing: RopePairing) -> Tensor<B, 4> {
    let [a, b, c, d] = x.dims();
    let half = d / 2;
    match pairing {
        RopePairing::Half => {
            let x1 = x.clone().slice([0..a, 0..b, 0..c, 0..half]);
            let x2 = x.slice([0..a, 0..b, 0..c, half..d]);
            Tensor::cat(vec![x2.neg(), x1], 3)
        }
        RopePairing::Interleaved => {
            let p = x.reshape([a, b, c, half, 2]);
            let x1 = p.clone().slice([0..a, 0..b, 0..c, 0..half, 0..1]);
            let x2 = p.slice([0..a, 0..b, 0..c, 0..half, 1..2]);
            Tensor::cat(vec![x2.neg(), x1], 4).reshape([a, b, c, d])
        }
    }
}

fn composite_one<B: Backend>(
    x: FloatTensor<B>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
    options: &RopeOptions,
) -> FloatTensor<B> {
    let x = float::<B, 4>(x);
    let dtype = x.dtype();
    let (_, _, seq, _) = options.layout.dims(x.dims());
    let c = full_table::<B>(cos, seq, dtype, options);
    let mut s = full_table::<B>(sin, seq, dtype, options);
    if options.inverse {
        s = s.neg();
    }
    (x.clone() * c + rotate(x, options.pairing) * s)
        .into_primitive()
        .tensor()
}

/// Reference with plain Burn ops.
pub fn composite<B: Backend>(
    q: FloatTensor<B>,
    k: Option<FloatTensor<B>>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
    options: RopeOptions,
) -> (FloatTensor<B>, Option<FloatTensor<B>>) {
    let k = k.map(|k| composite_one::<B>(k, cos.clone(), sin.clone(), &options));
    (composite_one::<B>(q, cos, sin, &options), k)
}

/// RoPE of `(q, k, cos, sin)` (k optional) in one launch, to the rotated
/// `(q, k)`; its backward is the same op with `options.inverse` flipped.
#[derive(Clone, Copy, Debug, Default)]
pub struct Rope {
    pub options: RopeOptions,
}

fused_op! {
    Rope: Some(Op::Rope), (F, Option<F>, F, F) => (F, Option<F>), differentiable,
    |_, (q, ..)| -> DTypeQuery { (B::float_device(q), DTypeQuery { dtype: q.dtype() }) }

    fn composite<B: Backend>(&self, (q, k, cos, sin): In<Self, B>) -> Out<Self, B> {
        composite::<B>(q, k, cos, sin, self.options)
    }

    fn kernels<K: KernelBackend>(&self, _: (), (q, k, cos, sin): In<Self, K>) -> Out<Self, K> {
        let has_k = k.is_some();
        let outputs = [Some(&q), k.as_ref()]
            .into_iter()
            .flatten()
            .map(TensorSpec::of)
            .collect();
        let inputs = [cos, sin, q].into_iter().chain(k).collect();
        let mut out = K::launch(self, inputs, vec![], outputs);
        let k = if has_k { out.pop() } else { None };
        (out.pop().expect("the rotated q"), k)
    }
}

/// Compiles (and autotunes) the RoPE kernel for head_dim 64 and 128.
pub(crate) fn warmup<B: BastileBackend>(device: &B::Device) {
    for head_dim in [64usize, 128] {
        let inv: Vec<f32> = (0..head_dim / 2)
            .map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / head_dim as f32))
            .collect();
        let tables = RopeTables::<B>::new(256, &inv, 1.0, device);
        let q = Tensor::<B, 4>::ones([1, 8, 256, head_dim], device);
        let k = Tensor::<B, 4>::ones([1, 2, 256, head_dim], device);
        let input = (
            q.into_primitive().tensor(),
            Some(k.into_primitive().tensor()),
            tables.cos.into_primitive().tensor(),
            tables.sin.into_primitive().tensor(),
        );
        let _ = B::run(&Rope::default(), input);
    }
    let _ = B::sync(device);
}
