"""Per-iteration GPU time of the MoE layer benchmark's routed layer in a
kernel trace (`kernel_trace.c`'s "K start end name" lines, ns): the
iterations are the spans between router top-k kernels that contain a
row gather; for the last N (default 10): the span, the products'
(cuBLASLt `nvjet`) time, the other kernels' time, the idle rest, and the
idle gaps over 0.05 ms with the kernels around them.

Usage: python3 layer_idle.py kernels.txt [N] (reads benches/cupti/placed_trace.py)
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../../../cupti"))
from placed_trace import read_unplaced  # noqa: E402

ks = read_unplaced(sys.argv[1])
n = int(sys.argv[2]) if len(sys.argv) > 2 else 10
tops = [i for i, k in enumerate(ks) if "top_k_softmax" in k[2]]
iters = [(a, b) for a, b in zip(tops, tops[1:]) if any("gather" in k[2] for k in ks[a:b])][-n:]
tot = [0.0, 0.0, 0.0]
for a, b in iters:
    span = (ks[b][0] - ks[a][0]) / 1e6
    gemm = sum(k[1] - k[0] for k in ks[a:b] if "nvjet" in k[2]) / 1e6
    other = sum(k[1] - k[0] for k in ks[a:b] if "nvjet" not in k[2]) / 1e6
    gaps = [
        "%.2f (%s > %s)" % ((ks[i + 1][0] - ks[i][1]) / 1e6, ks[i][2][:28], ks[i + 1][2][:28])
        for i in range(a, b)
        if (ks[i + 1][0] - ks[i][1]) / 1e6 > 0.05
    ]
    print("span %.2f ms: products %.2f, other kernels %.2f, idle %.2f; gaps %s"
          % (span, gemm, other, span - gemm - other, "; ".join(gaps)))
    tot = [t + v for t, v in zip(tot, (span, gemm, other))]
k = len(iters)
print("mean of %d: span %.2f ms, products %.2f, other kernels %.2f, idle %.2f"
      % (k, tot[0] / k, tot[1] / k, tot[2] / k, (tot[0] - tot[1] - tot[2]) / k))
