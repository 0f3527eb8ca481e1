"""What the host did while one GPU waited: the largest idle gaps between
kernels in one training step of a trace written with KERNEL_TRACE_API set
(`kernel_trace.c`: `K start end name` kernels, `A start end thread name`
CUDA driver calls, one clock), each with the driver calls that ran during
it, by thread, with their start (ms after the gap opened) and duration.
A gap that ends at a launch issued long after a wait returned is host time
spent between the two; one that ends right after the launch is issued is
the launch's own latency.

The step taken is the second to last in the trace (`placed_trace.py`'s
`last_whole_step`).

Usage: python3 host_gaps.py kernels.txt [MIN_GAP_MS (0.3)] [GAPS (8)] [CALLS (40)]
"""
import sys

from placed_trace import idle_gaps, last_whole_step

path = sys.argv[1]
min_gap_ms = float(sys.argv[2]) if len(sys.argv) > 2 else 0.3
count = int(sys.argv[3]) if len(sys.argv) > 3 else 8
calls_shown = int(sys.argv[4]) if len(sys.argv) > 4 else 40

kernels, calls = [], []
for line in open(path):
    parts = line.rstrip("\n").split(" ", 4)
    if parts[0] == "K":
        start, end, name = int(parts[1]), int(parts[2]), line.rstrip("\n").split(" ", 3)[3]
        kernels.append((start, end, name))
    elif parts[0] == "A" and len(parts) == 5:
        calls.append((int(parts[1]), int(parts[2]), int(parts[3]), parts[4]))
kernels.sort()
calls.sort()
if not calls:
    sys.exit(f"{path}: no driver calls: trace with KERNEL_TRACE_API set")

start, end = last_whole_step(kernels)
gaps = idle_gaps(kernels, start, end, min_gap_ms * 1e6)
total = sum(g[0] for g in gaps) / 1e6
print(f"step {(end - start) / 1e6:.1f} ms; {len(gaps)} gaps over {min_gap_ms} ms, {total:.1f} ms in all")
for length, opened, closed, before, after in sorted(gaps, reverse=True)[:count]:
    print(
        f"\n{length / 1e6:.2f} ms at {(opened - start) / 1e6:.1f} ms, after {before[:60]}, before {after[:60]}"
    )
    inside = [c for c in calls if c[1] >= opened and c[0] <= closed]
    by_name = {}
    for s, e, thread, name in inside:
        key = (thread, name)
        n, t = by_name.get(key, (0, 0))
        by_name[key] = (n + 1, t + (min(e, closed) - max(s, opened)))
    print("  driver time inside the gap by thread and call:")
    for (thread, name), (n, t) in sorted(by_name.items(), key=lambda x: -x[1][1])[:12]:
        print(f"    thread {thread}: {n:5d}x {name:<32} {t / 1e6:7.3f} ms")
    print("  the calls in order (ms after the gap opened, duration ms):")
    shown = [c for c in inside if c[1] - c[0] > 20e3 or "Launch" in c[3]][:calls_shown]
    for s, e, thread, name in shown:
        print(f"    {(s - opened) / 1e6:7.3f} {(e - s) / 1e6:7.3f}  thread {thread} {name}")
