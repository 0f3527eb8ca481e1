"""Per GPU, over the last W ms of a kernel trace written with
KERNEL_TRACE_PLACE set (`kernel_trace.c`: lines `K start end [dD sS] name`):
how long the GPU was busy with compute kernels, how long with NCCL's, and
how much of NCCL's time ran alongside compute (the communication hidden
behind the backward pass) rather than alone.

Usage: python3 streams_overlap.py kernels.txt [W]
"""
import sys

from placed_trace import read


def union(intervals):
    """Merged, sorted intervals."""
    merged = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def length(intervals):
    return sum(e - s for s, e in intervals)


def intersection(a, b):
    """Total length where two merged interval lists overlap."""
    i = j = 0
    total = 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            total += e - s
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


kernels = [(s, e, d, name) for s, e, d, _, name in read(sys.argv[1])]
window_ms = float(sys.argv[2]) if len(sys.argv) > 2 else 600
end = max(e for _, e, _, _ in kernels)
start = end - window_ms * 1e6
print(f"last {window_ms:.0f} ms of the trace")
print("device | compute busy ms | NCCL ms | NCCL alongside compute ms | NCCL alone ms")
for device in sorted({d for _, _, d, _ in kernels}):
    mine = [(max(s, start), e, n) for s, e, d, n in kernels if d == device and e > start]
    nccl = union([(s, e) for s, e, n in mine if "nccl" in n.lower()])
    compute = union([(s, e) for s, e, n in mine if "nccl" not in n.lower()])
    hidden = intersection(nccl, compute)
    print(
        f"{device} | {length(compute) / 1e6:.1f} | {length(nccl) / 1e6:.1f} | "
        f"{hidden / 1e6:.1f} | {(length(nccl) - hidden) / 1e6:.1f}"
    )
