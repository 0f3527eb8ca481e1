//! Attention in f64 over dense `[batch, heads, seq, head_dim]` values,
//! with the masks, GQA and sinks of [`crate::attention`].

/// The problem, in the reference's terms.
#[derive(Clone, Debug)]
pub struct AttentionSpec {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub seq_q: usize,
    pub seq_k: usize,
    pub head_dim: usize,
    pub scale: f64,
    pub causal: bool,
    pub window: Option<usize>,
    /// Real keys per batch entry (the rest are padding).
    pub key_lengths: Option<Vec<usize>>,
    /// The document of every key position (`[batch, seq_k]`): a query
    /// sees only the keys of its own position's document.
    pub documents: Option<Vec<usize>>,
    /// One logit per query head.
    pub sinks: Option<Vec<f64>>,
}

/// Gradients of the inputs (and of the sinks, when there are sinks).
#[derive(Clone, Debug)]
pub struct AttentionGrads {
    pub dq: Vec<f64>,
    pub dk: Vec<f64>,
    pub dv: Vec<f64>,
    pub dsinks: Vec<f64>,
}

impl AttentionSpec {
    /// Whether query `i` of batch entry `b` may attend key `j`.
    pub fn allowed(&self, b: usize, i: usize, j: usize) -> bool {
        let klen = self
            .key_lengths
            .as_ref()
            .map_or(self.seq_k, |l| l[b].min(self.seq_k));
        let pos = i as i64 + self.seq_k as i64 - self.seq_q as i64;
        let j = j as i64;
        let document = |p: i64| {
            self.documents
                .as_ref()
                .map(|d| d[b * self.seq_k + p.clamp(0, self.seq_k as i64 - 1) as usize])
        };
        j < klen as i64
            && (!self.causal || j <= pos)
            && self.window.is_none_or(|w| pos - j < w as i64)
            && document(j) == document(pos)
    }

    fn q_at(&self, b: usize, h: usize, i: usize) -> usize {
        ((b * self.heads + h) * self.seq_q + i) * self.head_dim
    }

    fn k_at(&self, b: usize, h: usize, j: usize) -> usize {
        let hk = h / (self.heads / self.kv_heads);
        ((b * self.kv_heads + hk) * self.seq_k + j) * self.head_dim
    }

    /// Probabilities of one row (`None` where masked) and of its sink, and
    /// the row's log-sum-exp (−∞ for a row that sees nothing).
    fn probs(&self, q: &[f64], k: &[f64], b: usize, h: usize, i: usize) -> RowProbs {
        let d = self.head_dim;
        let qi = &q[self.q_at(b, h, i)..][..d];
        let scores: Vec<Option<f64>> = (0..self.seq_k)
            .map(|j| {
                self.allowed(b, i, j).then(|| {
                    let kj = &k[self.k_at(b, h, j)..][..d];
                    self.scale * qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>()
                })
            })
            .collect();
        let sink = self.sinks.as_ref().map(|s| s[h]);
        let max = scores
            .iter()
            .flatten()
            .chain(sink.iter())
            .fold(f64::NEG_INFINITY, |m, &s| m.max(s));
        if max == f64::NEG_INFINITY {
            return RowProbs {
                p: vec![None; self.seq_k],
                sink: 0.0,
                lse: f64::NEG_INFINITY,
            };
        }
        let total: f64 = scores
            .iter()
            .flatten()
            .chain(sink.iter())
            .map(|s| (s - max).exp())
            .sum();
        let lse = max + total.ln();
        RowProbs {
            p: scores.iter().map(|s| s.map(|s| (s - lse).exp())).collect(),
            sink: sink.map_or(0.0, |s| (s - lse).exp()),
            lse,
        }
    }
}

struct RowProbs {
    p: Vec<Option<f64>>,
    sink: f64,
    lse: f64,
}

/// `(out, lse)`: the output `[batch, heads, seq_q, head_dim]` and the
/// per-row log-sum-exp `[batch, heads, seq_q]`.
pub fn forward(spec: &AttentionSpec, q: &[f64], k: &[f64], v: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let d = spec.head_dim;
    let mut out = vec![0.0; spec.batch * spec.heads * spec.seq_q * d];
    let mut lse = vec![0.0; spec.batch * spec.heads * spec.seq_q];
    for b in 0..spec.batch {
        for h in 0..spec.heads {
            for i in 0..spec.seq_q {
                let row = spec.probs(q, k, b, h, i);
                let o = &mut out[spec.q_at(b, h, i)..][..d];
                for (j, p) in row.p.iter().enumerate() {
                    if let Some(p) = p {
                        let vj = &v[spec.k_at(b, h, j)..][..d];
                        for (o, v) in o.iter_mut().zip(vj) {
                            *o += p * v;
                        }
                    }
                }
                lse[(b * spec.heads + h) * spec.seq_q + i] = row.lse;
            }
        }
    }
    (out, lse)
}

/// The gradients for the output gradient `dout`.
///
/// `out` is the output the backward reads for `Δ = rowsum(dout ∘ out)`.
/// Pass the kernel's own stored output (rounded to its dtype), which is
/// what the kernels read, so that the comparison measures the backward
/// alone: with the exact output, the sink gradient `−Σ p_sink·Δ`, a sum of
/// terms of either sign over a head's rows, carries the dtype's rounding of
/// every row and can miss the dtype's bound.
pub fn backward(
    spec: &AttentionSpec,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    out: &[f64],
    dout: &[f64],
) -> AttentionGrads {
    let d = spec.head_dim;
    assert_eq!(out.len(), dout.len(), "out and dout must have one shape");
    let mut dq = vec![0.0; q.len()];
    let mut dk = vec![0.0; k.len()];
    let mut dv = vec![0.0; v.len()];
    let mut dsinks = vec![0.0; if spec.sinks.is_some() { spec.heads } else { 0 }];
    for b in 0..spec.batch {
        for h in 0..spec.heads {
            for i in 0..spec.seq_q {
                let row = spec.probs(q, k, b, h, i);
                let at = spec.q_at(b, h, i);
                let go = &dout[at..][..d];
                let delta: f64 = go.iter().zip(&out[at..][..d]).map(|(a, b)| a * b).sum();
                if !dsinks.is_empty() {
                    dsinks[h] -= row.sink * delta;
                }
                for (j, p) in row.p.iter().enumerate() {
                    let Some(p) = *p else { continue };
                    let kat = spec.k_at(b, h, j);
                    let dp: f64 = go.iter().zip(&v[kat..][..d]).map(|(a, b)| a * b).sum();
                    let ds = p * (dp - delta) * spec.scale;
                    for c in 0..d {
                        dq[at + c] += ds * k[kat + c];
                        dk[kat + c] += ds * q[at + c];
                        dv[kat + c] += p * go[c];
                    }
                }
            }
        }
    }
    AttentionGrads { dq, dk, dv, dsinks }
}
