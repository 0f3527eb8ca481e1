//! The router's top-k choice and the softmax over it.

/// Every row's `k` largest of `experts` logits (ties to the lower index,
/// NaN above every number) and the softmax over them: `(weights,
/// indices)`, each `rows × k`, largest first.
pub fn top_k_softmax(logits: &[f64], experts: usize, k: usize) -> (Vec<f64>, Vec<usize>) {
    let mut weights = Vec::with_capacity(logits.len() / experts.max(1) * k);
    let mut indices = Vec::with_capacity(weights.capacity());
    for row in logits.chunks(experts) {
        // NaN first (among them, lower indices first), then larger values,
        // then lower indices.
        let rank = |e: usize| {
            let v = row[e];
            (!v.is_nan(), if v.is_nan() { 0.0 } else { -v }, e)
        };
        let mut order: Vec<usize> = (0..experts).collect();
        order.sort_by(|&a, &b| rank(a).partial_cmp(&rank(b)).expect("no NaN in a rank"));
        let chosen = &order[..k];
        let top = row[chosen[0]];
        let sum: f64 = chosen.iter().map(|&e| (row[e] - top).exp()).sum();
        weights.extend(chosen.iter().map(|&e| (row[e] - top).exp() / sum));
        indices.extend_from_slice(chosen);
    }
    (weights, indices)
}

/// The logits' gradient from the weights' gradient `dweights`: each
/// chosen logit gets `w_j · (dw_j − Σ_i w_i · dw_i)`, the others 0.
pub fn top_k_softmax_backward(
    weights: &[f64],
    indices: &[usize],
    dweights: &[f64],
    experts: usize,
    k: usize,
) -> Vec<f64> {
    let rows = weights.len() / k.max(1);
    let mut dlogits = vec![0.0; rows * experts];
    for r in 0..rows {
        let (w, dw) = (&weights[r * k..][..k], &dweights[r * k..][..k]);
        let dot: f64 = w.iter().zip(dw).map(|(a, b)| a * b).sum();
        for j in 0..k {
            dlogits[r * experts + indices[r * k + j]] += w[j] * (dw[j] - dot);
        }
    }
    dlogits
}
