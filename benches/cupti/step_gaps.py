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

from placed_trace import idle_gaps, last_whole_step, read

path, device = sys.argv[1], int(sys.argv[2])
min_gap_ms = float(sys.argv[3]) if len(sys.argv) > 3 else 0.3
count = int(sys.argv[4]) if len(sys.argv) > 4 else 15

compute = [
    (s, e, name) for s, e, d, _, name in read(path) if d == device and "nccl" not in name.lower()
]
start, end = last_whole_step(compute)
gaps = [
    (length / 1e6, (opened - start) / 1e6, before[:48], after[:48])
    for length, opened, _, before, after in idle_gaps(compute, start, end, min_gap_ms * 1e6)
]
total = sum(g[0] for g in gaps)
print(
    f"device {device}: step {(end - start) / 1e6:.1f} ms; {len(gaps)} gaps over "
    f"{min_gap_ms} ms, {total:.1f} ms in all"
)
for gap in sorted(gaps, reverse=True)[:count]:
    print("  %.2f ms at %.1f ms, after %s, before %s" % gap)
