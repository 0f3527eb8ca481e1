//! Rotary position embedding, q and k in one launch, forward and backward.
//!
//! Each head vector of `head_dim = 2·half` elements is rotated pair by pair
//! by the angle of its position: `(a, b) → (a·cos − b·sin, b·cos + a·sin)`.
//! [`RopePairing::Half`] pairs element `i` with `i + half` (HF
//! `rotate_half`); [`RopePairing::Interleaved`] pairs `2i` with `2i + 1`
//! (burn-nn's `RotaryEncoding`). The backward pass is the rotation by `−θ`
//! (`inverse`).
//!
//! The tables hold `cos` and `sin` of each position's angles, f32, `half`
//! values per row. As HF does (`cos.to(x.dtype)`), table values are rounded
//! to the input dtype and so is each product before the sum:
//! `out = cast(cast(a·c) − cast(b·s))`.
//!
//! q is `[batch, q_heads, seq, head_dim]` and k `[batch, k_heads, seq,
//! head_dim]` *logically*; any strides for the three outer dimensions are
//! taken (so `[batch, seq, heads, head_dim]` storage is just other strides),
//! the last dimension is contiguous. Position `s` of batch `b` reads table
//! row `offset + s` of the batch's table (one table shared by the batch, or
//! one per batch entry for explicit position ids).

use cubecl::prelude::*;
use cubecl::server::Handle;
use cubecl::tune::{LocalTuner, local_tuner};

use crate::elementwise::{
    Tile, TileLaunch, items_bucket, neg, round_through, run_tiled, tile_candidates, tile_item,
};
use crate::tune::Tuner;
use crate::{FloatDtype, KernelError, launch};

/// Which elements of a head vector form a rotated pair.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
pub enum RopePairing {
    /// `i` with `i + head_dim/2` (HF transformers `rotate_half`).
    #[default]
    Half,
    /// `2i` with `2i + 1` (burn-nn `RotaryEncoding`, Meta's original Llama layout).
    Interleaved,
}

/// The shape of a launch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeProblem {
    pub batch: usize,
    pub seq: usize,
    pub q_heads: usize,
    pub k_heads: usize,
    pub head_dim: usize,
    pub dtype: FloatDtype,
    pub pairing: RopePairing,
    /// Rotate by `−θ` (the backward pass).
    pub inverse: bool,
    /// Table row of sequence position 0.
    pub offset: usize,
    /// Rows of each table (per batch entry when `table_batched`).
    pub table_rows: usize,
    /// One table per batch entry (`[batch, table_rows, half]`) rather than
    /// one shared table (`[table_rows, half]`).
    pub table_batched: bool,
    /// A number every outer stride of q, k and the outputs is a multiple of.
    pub stride_multiple: usize,
}

impl RopeProblem {
    fn half(&self) -> usize {
        self.head_dim / 2
    }

    /// The f32 values of each table.
    fn table_len(&self) -> usize {
        let tables = if self.table_batched { self.batch } else { 1 };
        tables * self.table_rows * self.half()
    }

    fn validate(&self) -> Result<(), KernelError> {
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return Err(KernelError::Shape(format!(
                "RoPE needs an even, positive head_dim, got {}",
                self.head_dim
            )));
        }
        if self.stride_multiple == 0 {
            return Err(KernelError::Shape(
                "RoPE strides must be a positive multiple".into(),
            ));
        }
        if self.offset + self.seq > self.table_rows {
            return Err(KernelError::Shape(format!(
                "RoPE positions {}..{} exceed the table's {} rows",
                self.offset,
                self.offset + self.seq,
                self.table_rows
            )));
        }
        Ok(())
    }

    fn vector_size<R: Runtime>(&self, client: &ComputeClient<R>) -> usize {
        launch::vector_size(
            client,
            self.dtype,
            launch::gcd(self.half(), self.stride_multiple),
        )
    }

    fn rows(&self) -> (usize, usize) {
        (
            self.batch * self.q_heads * self.seq,
            self.batch * self.k_heads * self.seq,
        )
    }
}

/// Strides (in elements) of the batch, head and sequence dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadStrides {
    pub batch: usize,
    pub head: usize,
    pub seq: usize,
}

impl HeadStrides {
    /// The strides of a contiguous `[batch, heads, seq, head_dim]` tensor.
    pub fn bhsd(heads: usize, seq: usize, head_dim: usize) -> Self {
        Self {
            batch: heads * seq * head_dim,
            head: seq * head_dim,
            seq: head_dim,
        }
    }

    /// The strides of a contiguous `[batch, seq, heads, head_dim]` tensor.
    pub fn bshd(heads: usize, seq: usize, head_dim: usize) -> Self {
        Self {
            batch: heads * seq * head_dim,
            head: head_dim,
            seq: heads * head_dim,
        }
    }

    /// Whether every stride is a whole number of vectors of `v`.
    fn whole_vectors(&self, v: usize) -> bool {
        [self.batch, self.head, self.seq]
            .iter()
            .all(|s| s.is_multiple_of(v))
    }

    fn vecs(&self, v: usize) -> Self {
        assert!(
            self.whole_vectors(v),
            "RoPE strides not a multiple of the vector width"
        );
        Self {
            batch: self.batch / v,
            head: self.head / v,
            seq: self.seq / v,
        }
    }

    /// The largest offset reached, plus one row: the buffer length in elements.
    fn extent(&self, batch: usize, heads: usize, seq: usize, head_dim: usize) -> usize {
        (batch - 1) * self.batch + (heads - 1) * self.head + (seq - 1) * self.seq + head_dim
    }
}

/// One head tensor: a buffer and its outer strides.
#[derive(Clone, Debug)]
pub struct HeadTensor {
    pub handle: Handle,
    pub strides: HeadStrides,
}

impl HeadTensor {
    /// The buffer reaches the last row of `heads` heads, and the strides
    /// are whole vectors of `v`.
    fn check(
        &self,
        what: &str,
        p: &RopeProblem,
        heads: usize,
        v: usize,
    ) -> Result<(), KernelError> {
        let s = &self.strides;
        if !s.whole_vectors(v) {
            return Err(KernelError::Shape(format!(
                "RoPE {what}: strides {s:?} are not whole vectors of {v}"
            )));
        }
        let what = format!("RoPE {what}");
        launch::check_holds(&what, &self.handle, self.len(p, heads), p.dtype.size())
    }

    /// The elements the launch reaches: one past the last of `heads` heads
    /// (none for an empty tensor).
    fn len(&self, p: &RopeProblem, heads: usize) -> usize {
        if p.batch * heads * p.seq == 0 {
            0
        } else {
            self.strides.extent(p.batch, heads, p.seq, p.head_dim)
        }
    }

    fn arg<R: Runtime>(&self, problem: &RopeProblem, heads: usize) -> TensorArg<R> {
        // An empty tensor still takes an argument of one row.
        let len = self.len(problem, heads).max(problem.head_dim);
        unsafe { TensorArg::from_raw_parts(self.handle.clone(), vec![1].into(), vec![len].into()) }
    }
}

/// The buffers of a launch. `cos` and `sin` are dense f32 tables.
#[derive(Clone, Debug)]
pub struct RopeBuffers {
    pub q: HeadTensor,
    pub k: HeadTensor,
    pub q_out: HeadTensor,
    pub k_out: HeadTensor,
    pub cos: Handle,
    pub sin: Handle,
}

impl RopeBuffers {
    /// Each buffer holds what the launch reads and writes, strides whole
    /// vectors of `v`.
    fn check(&self, p: &RopeProblem, v: usize) -> Result<(), KernelError> {
        for (what, t, heads) in [
            ("q", &self.q, p.q_heads),
            ("k", &self.k, p.k_heads),
            ("q out", &self.q_out, p.q_heads),
            ("k out", &self.k_out, p.k_heads),
        ] {
            t.check(what, p, heads, v)?;
        }
        launch::check_holds("the RoPE cos table", &self.cos, p.table_len(), 4)?;
        launch::check_holds("the RoPE sin table", &self.sin, p.table_len(), 4)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct RopeConfig {
    tile: Tile,
    interleaved: bool,
    inverse: bool,
    table_batched: bool,
}

/// `(a·c − b·s, b·c + a·s)` with the products rounded through `F`.
#[cube]
fn rotate<F: Float, N: Size>(
    a: Vector<f32, N>,
    b: Vector<f32, N>,
    c: Vector<f32, N>,
    s: Vector<f32, N>,
) -> (Vector<f32, N>, Vector<f32, N>) {
    let ac = round_through::<F, N>(a * c);
    let bs = round_through::<F, N>(b * s);
    let bc = round_through::<F, N>(b * c);
    let as_ = round_through::<F, N>(a * s);
    (ac - bs, bc + as_)
}

/// Rotates item `col` of row `row` of one head tensor.
#[cube]
#[allow(clippy::too_many_arguments)]
fn rotate_item<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    out: &mut Tensor<Vector<F, N>>,
    cos: &Tensor<Vector<f32, N>>,
    sin: &Tensor<Vector<f32, N>>,
    row: usize,
    col: usize,
    heads: usize,
    seq: usize,
    offset: usize,
    table_rows: usize,
    x_strides: (usize, usize, usize),
    out_strides: (usize, usize, usize),
    #[comptime] cfg: RopeConfig,
) {
    let si = row % seq;
    let bh = row / seq;
    let hi = bh % heads;
    let bi = bh / heads;
    let (xb, xh, xs) = x_strides;
    let (ob, oh, os) = out_strides;
    let x_at = bi * xb + hi * xh + si * xs;
    let o_at = bi * ob + hi * oh + si * os;

    let mut trow = offset + si;
    if comptime![cfg.table_batched] {
        trow += bi * table_rows;
    }
    let t_at = trow * cfg.tile.row_items as usize + col;
    let c = round_through::<F, N>(cos[t_at]);
    let mut s = round_through::<F, N>(sin[t_at]);
    if comptime![cfg.inverse] {
        s = neg(s);
    }

    if comptime![cfg.interleaved] {
        // Item `col` covers the pairs of vectors 2·col and 2·col + 1.
        let n = N::value();
        let v0 = Vector::<f32, N>::cast_from(x[x_at + 2 * col]);
        let v1 = Vector::<f32, N>::cast_from(x[x_at + 2 * col + 1]);
        let mut span = Array::<f32>::new(comptime![2 * n]);
        #[unroll]
        for l in 0..n {
            span[l] = v0[l];
            span[n + l] = v1[l];
        }
        let mut a = Vector::<f32, N>::new(0.0);
        let mut b = Vector::<f32, N>::new(0.0);
        #[unroll]
        for j in 0..n {
            a[j] = span[2 * j];
            b[j] = span[2 * j + 1];
        }
        let (ra, rb) = rotate::<F, N>(a, b, c, s);
        #[unroll]
        for j in 0..n {
            span[2 * j] = ra[j];
            span[2 * j + 1] = rb[j];
        }
        let mut w0 = Vector::<f32, N>::new(0.0);
        let mut w1 = Vector::<f32, N>::new(0.0);
        #[unroll]
        for l in 0..n {
            w0[l] = span[l];
            w1[l] = span[n + l];
        }
        out[o_at + 2 * col] = Vector::cast_from(w0);
        out[o_at + 2 * col + 1] = Vector::cast_from(w1);
    } else {
        let half = cfg.tile.row_items as usize;
        let a = Vector::<f32, N>::cast_from(x[x_at + col]);
        let b = Vector::<f32, N>::cast_from(x[x_at + half + col]);
        let (ra, rb) = rotate::<F, N>(a, b, c, s);
        out[o_at + col] = Vector::cast_from(ra);
        out[o_at + half + col] = Vector::cast_from(rb);
    }
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rope_kernel<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    q_out: &mut Tensor<Vector<F, N>>,
    k_out: &mut Tensor<Vector<F, N>>,
    cos: &Tensor<Vector<f32, N>>,
    sin: &Tensor<Vector<f32, N>>,
    q_b: usize,
    q_h: usize,
    q_s: usize,
    k_b: usize,
    k_h: usize,
    k_s: usize,
    qo_b: usize,
    qo_h: usize,
    qo_s: usize,
    ko_b: usize,
    ko_h: usize,
    ko_s: usize,
    q_rows: usize,
    k_rows: usize,
    q_heads: usize,
    k_heads: usize,
    seq: usize,
    offset: usize,
    table_rows: usize,
    #[comptime] cfg: RopeConfig,
    #[define(F)] _dtype: StorageType,
) {
    #[unroll]
    for it in 0..cfg.tile.items_per_unit as usize {
        let item = tile_item(it, cfg.tile);
        let row = item / cfg.tile.row_items as usize;
        let col = item % cfg.tile.row_items as usize;
        if row < q_rows {
            rotate_item::<F, N>(
                q,
                q_out,
                cos,
                sin,
                row,
                col,
                q_heads,
                seq,
                offset,
                table_rows,
                (q_b, q_h, q_s),
                (qo_b, qo_h, qo_s),
                cfg,
            );
        } else if row < q_rows + k_rows {
            rotate_item::<F, N>(
                k,
                k_out,
                cos,
                sin,
                row - q_rows,
                col,
                k_heads,
                seq,
                offset,
                table_rows,
                (k_b, k_h, k_s),
                (ko_b, ko_h, ko_s),
                cfg,
            );
        }
    }
}

/// Launches the kernel with one explicit configuration.
pub fn rope_with<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &RopeProblem,
    buffers: &RopeBuffers,
    config: &TileLaunch,
) -> Result<(), KernelError> {
    problem.validate()?;
    config.check(client)?;
    let v = config.vector_size;
    if !problem.half().is_multiple_of(v) || !problem.stride_multiple.is_multiple_of(v) {
        return Err(KernelError::Unsupported(format!(
            "vector size {v} does not divide the RoPE rows of {problem:?}"
        )));
    }
    let (q_rows, k_rows) = problem.rows();
    if q_rows + k_rows == 0 {
        return Ok(());
    }
    let row_items = problem.half() / v;
    let table_len = problem.table_len();
    buffers.check(problem, v)?;
    let table = |h: &Handle| unsafe {
        TensorArg::<R>::from_raw_parts(h.clone(), vec![1].into(), vec![table_len].into())
    };
    let [q, k, qo, ko] =
        [&buffers.q, &buffers.k, &buffers.q_out, &buffers.k_out].map(|t| t.strides.vecs(v));
    let cfg = RopeConfig {
        tile: config.tile(row_items),
        interleaved: problem.pairing == RopePairing::Interleaved,
        inverse: problem.inverse,
        table_batched: problem.table_batched,
    };
    unsafe {
        rope_kernel::launch_unchecked::<R>(
            client,
            config.cube_count(client, (q_rows + k_rows) * row_items)?,
            config.cube_dim(),
            v,
            buffers.q.arg(problem, problem.q_heads),
            buffers.k.arg(problem, problem.k_heads),
            buffers.q_out.arg(problem, problem.q_heads),
            buffers.k_out.arg(problem, problem.k_heads),
            table(&buffers.cos),
            table(&buffers.sin),
            q.batch,
            q.head,
            q.seq,
            k.batch,
            k.head,
            k.seq,
            qo.batch,
            qo.head,
            qo.seq,
            ko.batch,
            ko.head,
            ko.seq,
            q_rows,
            k_rows,
            problem.q_heads,
            problem.k_heads,
            problem.seq,
            problem.offset,
            problem.table_rows,
            cfg,
            problem.dtype.storage(),
        )
    }
    Ok(())
}

/// Every configuration worth trying for `problem` on this device.
pub fn candidates<R: Runtime>(client: &ComputeClient<R>, problem: &RopeProblem) -> Vec<TileLaunch> {
    tile_candidates(client, problem.vector_size(client))
}

/// The autotune key.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct RopeKey {
    pub items_bucket: usize,
    pub head_dim: usize,
    pub dtype: FloatDtype,
    pub vector_size: usize,
    pub pairing: RopePairing,
}

impl core::fmt::Display for RopeKey {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(
            f,
            "rope items~{} head_dim={} {} vec={} {:?}",
            self.items_bucket, self.head_dim, self.dtype, self.vector_size, self.pairing
        )
    }
}

static TUNER: Tuner<RopeKey> = local_tuner!("bastile-rope");

/// Forgets every tuning decision taken in this process.
pub fn clear_autotune() {
    TUNER.clear();
}

/// Runs the kernel with the autotuned configuration.
pub fn rope<R: Runtime>(
    client: &ComputeClient<R>,
    device: &R::Device,
    problem: &RopeProblem,
    buffers: &RopeBuffers,
) -> Result<(), KernelError> {
    problem.validate()?;
    buffers.check(problem, 1)?;
    let vector_size = problem.vector_size(client);
    let (q_rows, k_rows) = problem.rows();
    let key = RopeKey {
        items_bucket: items_bucket((q_rows + k_rows) * problem.half() / vector_size),
        head_dim: problem.head_dim,
        dtype: problem.dtype,
        vector_size,
        pairing: problem.pairing,
    };
    run_tiled(
        &TUNER,
        key,
        vector_size,
        rope_with::<R>,
        client,
        device,
        problem,
        buffers,
    )
}
