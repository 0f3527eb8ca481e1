//! How a strided, batched, broadcast matmul `out[.., M, N] = lhs[.., M, K] ·
//! rhs[.., K, N]` maps onto column-major BLAS calls (cuBLASLt): which
//! operand is transposed, the leading dimensions, one strided batch, and
//! the element offsets of any further calls. Pure shape arithmetic, so it
//! is tested without a GPU.
//!
//! BLAS is column-major and Burn is row-major, so the call computes
//! `outᵀ[N, M] = rhsᵀ · lhsᵀ`: a row-major matrix is its transpose in
//! column-major order at no cost, and `out` is written row-major
//! (contiguous) without a copy.

use crate::KernelError;

/// Calls beyond this many (batch groups whose strides do not collapse into
/// one) are left to the caller's fallback instead of looped here.
pub const MAX_CALLS: usize = 1024;

/// How one operand's matrix is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Order {
    /// Elements of a row are adjacent; rows `ld` apart.
    Row,
    /// Elements of a column are adjacent; columns `ld` apart.
    Col,
}

/// One operand of the column-major call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlasOperand {
    /// Whether BLAS transposes it (`op = T`).
    pub transposed: bool,
    /// Rows and columns of the stored column-major matrix (before `op`).
    pub rows: usize,
    pub cols: usize,
    /// Leading dimension, in elements.
    pub ld: usize,
    /// Elements between consecutive matrices of the strided batch (0:
    /// broadcast).
    pub batch_stride: usize,
}

/// A matmul as `calls.len()` column-major calls of `batch` matrices each:
/// `D[m, n] = op(a) · op(b)` with `a` from `rhs` and `b` from `lhs`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GemmPlan {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// BLAS's `A`: the right-hand operand.
    pub a: BlasOperand,
    /// BLAS's `B`: the left-hand operand.
    pub b: BlasOperand,
    /// Leading dimension and batch stride of the (contiguous) output.
    pub ldd: usize,
    pub d_batch_stride: usize,
    pub batch: usize,
    /// Element offsets `[lhs, rhs, out]` of each call.
    pub calls: Vec<[usize; 3]>,
    /// The output's shape (broadcast batch dimensions, then `[M, N]`).
    pub out_shape: Vec<usize>,
}

/// Why a plan could not be made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PlanError {
    /// The shapes do not multiply (the caller validates user input first,
    /// so this is an internal error there).
    Shape(String),
    /// The strides are not expressible (e.g. a broadcast inside a matrix,
    /// or too many batch groups): make the operands contiguous and retry,
    /// or take another path.
    Layout(String),
}

impl From<PlanError> for KernelError {
    fn from(e: PlanError) -> Self {
        match e {
            PlanError::Shape(s) => KernelError::Shape(s),
            PlanError::Layout(s) => KernelError::Unsupported(s),
        }
    }
}

/// The storage order and leading dimension of a `rows × cols` matrix with
/// these strides, if BLAS can read it in place.
pub fn storage(rows: usize, cols: usize, rs: usize, cs: usize) -> Option<(Order, usize)> {
    let row_major = (cols <= 1 || cs == 1) && (rows <= 1 || rs >= cols.max(1));
    if row_major {
        let ld = if rows <= 1 { cols.max(1) } else { rs };
        return Some((Order::Row, ld));
    }
    let col_major = (rows <= 1 || rs == 1) && (cols <= 1 || cs >= rows.max(1));
    if col_major {
        let ld = if cols <= 1 { rows.max(1) } else { cs };
        return Some((Order::Col, ld));
    }
    None
}

/// Plans `lhs[.., M, K] · rhs[.., K, N]` for operands of equal rank with
/// broadcastable batch dimensions (size-1 dimensions broadcast).
pub fn plan_matmul(
    lhs_shape: &[usize],
    lhs_strides: &[usize],
    rhs_shape: &[usize],
    rhs_strides: &[usize],
) -> Result<GemmPlan, PlanError> {
    let rank = lhs_shape.len();
    if rank < 2 || rhs_shape.len() != rank {
        return Err(PlanError::Shape(format!(
            "matmul needs two operands of equal rank >= 2, got {lhs_shape:?} and {rhs_shape:?}"
        )));
    }
    let (m, k) = (lhs_shape[rank - 2], lhs_shape[rank - 1]);
    let (k2, n) = (rhs_shape[rank - 2], rhs_shape[rank - 1]);
    if k != k2 {
        return Err(PlanError::Shape(format!(
            "matmul inner dimensions differ: {lhs_shape:?} · {rhs_shape:?}"
        )));
    }

    let mut out_shape = Vec::with_capacity(rank);
    for d in 0..rank - 2 {
        let (l, r) = (lhs_shape[d], rhs_shape[d]);
        if l != r && l != 1 && r != 1 {
            return Err(PlanError::Shape(format!(
                "matmul batch dimension {d} does not broadcast: {lhs_shape:?} · {rhs_shape:?}"
            )));
        }
        out_shape.push(l.max(r));
    }
    out_shape.extend([m, n]);

    let (lhs_order, lhs_ld) = storage(m, k, lhs_strides[rank - 2], lhs_strides[rank - 1])
        .ok_or_else(|| PlanError::Layout(format!("lhs strides {lhs_strides:?}")))?;
    let (rhs_order, rhs_ld) = storage(k, n, rhs_strides[rank - 2], rhs_strides[rank - 1])
        .ok_or_else(|| PlanError::Layout(format!("rhs strides {rhs_strides:?}")))?;

    // Batch strides per output batch dimension; a broadcast dimension reads
    // the same matrix (stride 0).
    let out_matrix = m * n;
    let mut out_stride = out_matrix;
    let mut dims = Vec::new(); // innermost first: (count, [lhs, rhs, out] strides)
    for d in (0..rank - 2).rev() {
        let count = out_shape[d];
        let pick = |shape: &[usize], strides: &[usize]| if shape[d] == 1 { 0 } else { strides[d] };
        if count > 1 {
            dims.push((
                count,
                [
                    pick(lhs_shape, lhs_strides),
                    pick(rhs_shape, rhs_strides),
                    out_stride,
                ],
            ));
        }
        out_stride *= count;
    }

    // Merge adjacent batch dimensions whose strides continue each other in
    // every operand: the innermost group becomes the strided batch.
    let mut groups: Vec<(usize, [usize; 3])> = Vec::new();
    for (count, strides) in dims {
        match groups.last_mut() {
            Some((gc, gs)) if (0..3).all(|i| strides[i] == gs[i] * *gc) => *gc *= count,
            _ => groups.push((count, strides)),
        }
    }
    // The largest group becomes the strided batch and the others are
    // looped as calls: a GQA product `[b, kv, group, ..] · [b, kv, 1, ..]`
    // then runs as `group` calls of `kv` matrices, not the other way round.
    let (batch, batch_strides) =
        match (0..groups.len()).max_by_key(|&i| (groups[i].0, usize::MAX - i)) {
            Some(i) => groups.remove(i),
            None => (1, [0, 0, out_matrix]),
        };

    let mut calls = vec![[0usize; 3]];
    for (count, strides) in groups {
        if calls.len() * count > MAX_CALLS {
            return Err(PlanError::Layout(format!(
                "more than {MAX_CALLS} batch groups with unrelated strides"
            )));
        }
        calls = (0..count)
            .flat_map(|i| {
                calls
                    .iter()
                    .map(move |c| [0, 1, 2].map(|o| c[o] + i * strides[o]))
            })
            .collect();
    }

    // BLAS's A is rhsᵀ [N, K] (a row-major rhs is exactly that) and its B
    // is lhsᵀ [K, M].
    let a = blas_operand(rhs_order, [n, k], rhs_ld, batch_strides[1]);
    let b = blas_operand(lhs_order, [k, m], lhs_ld, batch_strides[0]);

    Ok(GemmPlan {
        m: n,
        n: m,
        k,
        a,
        b,
        ldd: n.max(1),
        d_batch_stride: batch_strides[2],
        batch,
        calls,
        out_shape,
    })
}

/// The column-major BLAS operand `[rows, cols]` read from a buffer in
/// `order`: a row-major buffer already is that matrix in column-major
/// terms; a column-major one is its transpose.
fn blas_operand(
    order: Order,
    [rows, cols]: [usize; 2],
    ld: usize,
    batch_stride: usize,
) -> BlasOperand {
    match order {
        Order::Row => BlasOperand {
            transposed: false,
            rows,
            cols,
            ld,
            batch_stride,
        },
        Order::Col => BlasOperand {
            transposed: true,
            rows: cols,
            cols: rows,
            ld,
            batch_stride,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Contiguous row-major strides of `shape`.
    fn contiguous(shape: &[usize]) -> Vec<usize> {
        let mut strides = vec![1; shape.len()];
        for d in (0..shape.len().saturating_sub(1)).rev() {
            strides[d] = strides[d + 1] * shape[d + 1];
        }
        strides
    }

    /// Runs the plan on the host (column-major semantics, exactly as BLAS
    /// reads the buffers) and compares with a direct strided matmul.
    fn check(
        lhs_shape: &[usize],
        lhs_strides: &[usize],
        rhs_shape: &[usize],
        rhs_strides: &[usize],
    ) {
        let span = |shape: &[usize], strides: &[usize]| {
            1 + shape
                .iter()
                .zip(strides)
                .map(|(s, t)| (s - 1) * t)
                .sum::<usize>()
        };
        let lhs: Vec<f64> = (0..span(lhs_shape, lhs_strides))
            .map(|i| (i as f64 * 0.37).sin())
            .collect();
        let rhs: Vec<f64> = (0..span(rhs_shape, rhs_strides))
            .map(|i| (i as f64 * 0.91).cos())
            .collect();
        let plan = plan_matmul(lhs_shape, lhs_strides, rhs_shape, rhs_strides).unwrap();
        let total: usize = plan.out_shape.iter().product();
        let mut out = vec![f64::NAN; total];
        let at = |op: &BlasOperand, buf: &[f64], base: usize, r: usize, c: usize| {
            // Element (r, c) of op(X): op = T swaps the stored indices.
            let (sr, sc) = if op.transposed { (c, r) } else { (r, c) };
            buf[base + sr + sc * op.ld]
        };
        for call in &plan.calls {
            for bi in 0..plan.batch {
                let (lb, rb, ob) = (
                    call[0] + bi * plan.b.batch_stride,
                    call[1] + bi * plan.a.batch_stride,
                    call[2] + bi * plan.d_batch_stride,
                );
                for i in 0..plan.m {
                    for j in 0..plan.n {
                        let s: f64 = (0..plan.k)
                            .map(|p| at(&plan.a, &rhs, rb, i, p) * at(&plan.b, &lhs, lb, p, j))
                            .sum();
                        out[ob + i + j * plan.ldd] = s;
                    }
                }
            }
        }
        // Direct evaluation over the broadcast batch index.
        let rank = lhs_shape.len();
        let (m, k, n) = (
            lhs_shape[rank - 2],
            lhs_shape[rank - 1],
            rhs_shape[rank - 1],
        );
        let out_strides = contiguous(&plan.out_shape);
        let batch_shape = &plan.out_shape[..rank - 2];
        let batches: usize = batch_shape.iter().product();
        for flat in 0..batches {
            let mut rem = flat;
            let mut idx = vec![0; rank - 2];
            for d in (0..rank - 2).rev() {
                idx[d] = rem % batch_shape[d];
                rem /= batch_shape[d];
            }
            let base = |shape: &[usize], strides: &[usize]| -> usize {
                (0..rank - 2)
                    .map(|d| {
                        if shape[d] == 1 {
                            0
                        } else {
                            idx[d] * strides[d]
                        }
                    })
                    .sum()
            };
            let (lb, rb) = (base(lhs_shape, lhs_strides), base(rhs_shape, rhs_strides));
            let ob: usize = (0..rank - 2).map(|d| idx[d] * out_strides[d]).sum();
            for i in 0..m {
                for j in 0..n {
                    let e: f64 = (0..k)
                        .map(|p| {
                            lhs[lb + i * lhs_strides[rank - 2] + p * lhs_strides[rank - 1]]
                                * rhs[rb + p * rhs_strides[rank - 2] + j * rhs_strides[rank - 1]]
                        })
                        .sum();
                    let got = out[ob + i * n + j];
                    assert!(
                        (got - e).abs() < 1e-12,
                        "{lhs_shape:?}·{rhs_shape:?} [{flat},{i},{j}]: {got} vs {e}"
                    );
                }
            }
        }
    }

    #[test]
    fn contiguous_square_and_skinny() {
        check(&[5, 7], &contiguous(&[5, 7]), &[7, 3], &contiguous(&[7, 3]));
        check(&[1, 9], &contiguous(&[1, 9]), &[9, 1], &contiguous(&[9, 1]));
        check(&[6, 1], &contiguous(&[6, 1]), &[1, 4], &contiguous(&[1, 4]));
        check(&[1, 1], &[1, 1], &[1, 1], &[1, 1]);
    }

    #[test]
    fn transposed_views() {
        // lhsᵀ view of a [7, 5] buffer, rhsᵀ view of a [3, 7] buffer.
        check(&[5, 7], &[1, 5], &[7, 3], &[1, 7]);
        check(&[5, 7], &[1, 5], &[7, 3], &[3, 1]);
        // Padded rows (a slice of a wider buffer).
        check(&[4, 6], &[10, 1], &[6, 3], &[1, 8]);
    }

    #[test]
    fn batched_and_broadcast() {
        let l = [2, 3, 4, 5];
        let r = [2, 3, 5, 6];
        let plan = plan_matmul(&l, &contiguous(&l), &r, &contiguous(&r)).unwrap();
        assert_eq!((plan.batch, plan.calls.len()), (6, 1));
        check(&l, &contiguous(&l), &r, &contiguous(&r));
        // rhs broadcast over every batch dimension: one strided batch.
        let r1 = [1, 1, 5, 6];
        let plan = plan_matmul(&l, &contiguous(&l), &r1, &contiguous(&r1)).unwrap();
        assert_eq!(
            (plan.batch, plan.calls.len(), plan.a.batch_stride),
            (6, 1, 0)
        );
        check(&l, &contiguous(&l), &r1, &contiguous(&r1));
        // rhs broadcast over the outer dimension only: strides do not
        // continue, so two calls of three.
        let r2 = [1, 3, 5, 6];
        let plan = plan_matmul(&l, &contiguous(&l), &r2, &contiguous(&r2)).unwrap();
        assert_eq!((plan.batch, plan.calls.len()), (3, 2));
        check(&l, &contiguous(&l), &r2, &contiguous(&r2));
        // GQA: rhs broadcast over the inner (group) dimension only; the
        // larger kv-head dimension is the strided batch, the group loops.
        let (lg, rg) = ([2, 4, 3, 2, 5], [2, 4, 1, 5, 6]);
        let plan = plan_matmul(&lg, &contiguous(&lg), &rg, &contiguous(&rg)).unwrap();
        assert_eq!((plan.batch, plan.calls.len()), (8, 3));
        check(&lg, &contiguous(&lg), &rg, &contiguous(&rg));
        // lhs broadcast both ways around, with a transposed rhs.
        check(
            &[2, 1, 4, 5],
            &contiguous(&[2, 1, 4, 5]),
            &[1, 3, 5, 6],
            &[0, 30, 1, 5],
        );
    }

    #[test]
    fn unsupported_layouts_and_bad_shapes() {
        // A broadcast row inside a matrix (stride 0) cannot be read in place.
        assert!(matches!(
            plan_matmul(&[4, 5], &[0, 1], &[5, 3], &[3, 1]),
            Err(PlanError::Layout(_))
        ));
        assert!(matches!(
            plan_matmul(&[4, 5], &[5, 1], &[6, 3], &[3, 1]),
            Err(PlanError::Shape(_))
        ));
        assert!(matches!(
            plan_matmul(&[2, 4, 5], &[20, 5, 1], &[3, 5, 3], &[15, 3, 1]),
            Err(PlanError::Shape(_))
        ));
    }
}
