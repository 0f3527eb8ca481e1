"""Where one GPU waited during a training step: the idle gaps between its
compute kernels (NCCL's excluded) in one step of a kernel trace written
with KERNEL_TRACE_PLACE set (`kernel_trace.c`). A step runs from the end
of one optimizer update (the last `adamw_kernel` launch before a pause of
over 5 ms) to the end of the next; the step taken is the second to last in
the trace. Each gap is printed with the kernels before and after it, the
longest first, so a wait for a collective operation or for the host shows
with its place in the step.

Usage: python3 step_gaps.py kernels.txt DEVICE [MIN_GAP_MS] [COUNT]
"""
import sys

from placed_trace import read

path, device = sys.argv[1], int(sys.argv[2])
min_gap_ms = float(sys.argv[3]) if len(sys.argv) > 3 else 0.3
count = int(sys.argv[4]) if len(sys.argv) > 4 else 15

compute = [
    (s, e, name) for s, e, d, _, name in read(path) if d == device and "nccl" not in name.lower()
]
updates = [k for k in compute if "adamw_kernel" in k[2]]
ends = [
    k[1]
    for i, k in enumerate(updates)
    if i + 1 == len(updates) or updates[i + 1][0] - k[1] > 5e6
]
if len(ends) < 3:
    sys.exit("fewer than two whole steps in the trace")
start, end = ends[-3], ends[-2]
last, before, gaps = start, "(step start)", []
for s, e, name in compute:
    if not start < s <= end:
        continue
    if s - last > min_gap_ms * 1e6:
        gaps.append(((s - last) / 1e6, (last - start) / 1e6, before[:48], name[:48]))
    if e > last:
        last, before = e, name
total = sum(g[0] for g in gaps)
print(
    f"device {device}: step {(end - start) / 1e6:.1f} ms; {len(gaps)} gaps over "
    f"{min_gap_ms} ms, {total:.1f} ms in all"
)
for gap in sorted(gaps, reverse=True)[:count]:
    print("  %.2f ms at %.1f ms, after %s, before %s" % gap)
