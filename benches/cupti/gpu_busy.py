"""GPU busy time over the end of a kernel trace (`kernel_trace.c`'s
"K start end name" lines, ns): the union of the kernels' intervals over
the last W ms (default 600, a few training steps), per 100 ms window, and
the kernel time by name over the same span.

Usage: python3 gpu_busy.py kernels.txt [W]
"""
import sys

from placed_trace import read_unplaced

ks = read_unplaced(sys.argv[1])
end = max(e for _, e, _ in ks)
print("kernels", len(ks))
def busy(t0, t1):
    tot, cs, ce = 0, None, None
    n = 0
    for s, e, _ in ks:
        if e <= t0 or s >= t1:
            continue
        n += 1
        s, e = max(s, t0), min(e, t1)
        if ce is None or s > ce:
            if ce is not None:
                tot += ce - cs
            cs, ce = s, e
        else:
            ce = max(ce, e)
    if ce is not None:
        tot += ce - cs
    return tot, n
w = int(sys.argv[2]) if len(sys.argv) > 2 else 600
t0 = end - w * 1_000_000
b, n = busy(t0, end)
print(f"last {w} ms: {n} kernels, GPU busy {b/1e6:.1f} ms ({100*b/(w*1e6):.0f}%)")
for i in range(w // 100):
    a = t0 + i * 100_000_000
    b, n = busy(a, a + 100_000_000)
    print(f"  window {i}: {n} kernels, busy {b/1e6:.1f} of 100 ms")
agg = {}
for s, e, name in ks:
    if s >= t0:
        t, c = agg.get(name[:100], (0, 0))
        agg[name[:100]] = (t + e - s, c + 1)
print("kernel time by name over that window:")
for name, (t, c) in sorted(agg.items(), key=lambda x: -x[1][0])[:30]:
    print(f"{t/1e6:8.2f} ms {c:6d}x {name}")
