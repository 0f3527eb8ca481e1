"""GPU time of the fused AdamW step in a kernel trace (`kernel_trace.c`'s
"K start end name" lines): for the last 20 steps (a step runs from its
first gradient-norm kernel to its last update kernel), the medians of the
norm's, the clip factor's and the update's kernel time, of all three, and
of the step's span on the GPU (ms).

Usage: python3 step_busy.py k-adamw.txt.xz (reads benches/cupti/placed_trace.py)
"""
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../../cupti"))
from placed_trace import read_unplaced  # noqa: E402

kernels = [k for k in read_unplaced(sys.argv[1])
           if any(n in k[2] for n in ("adamw_kernel", "sum_squares", "clip_scale"))]
steps, step = [], []
for k in kernels:
    # A norm kernel after an update kernel starts the next step.
    if "sum_squares" in k[2] and step and "adamw" in step[-1][2]:
        steps.append(step)
        step = []
    step.append(k)
steps = (steps + [step])[-20:]


def median_ms(per_step):
    return statistics.median(per_step(s) for s in steps) / 1e6


def kernel_time(part):
    return lambda s: sum(e - b for b, e, name in s if part in name)


print(os.path.basename(os.path.dirname(sys.argv[1])), "steps", len(steps),
      "norm %.3f" % median_ms(kernel_time("sum_squares")),
      "clip %.3f" % median_ms(kernel_time("clip_scale")),
      "update %.3f" % median_ms(kernel_time("adamw")),
      "busy %.3f" % median_ms(kernel_time("")),
      "span %.2f" % median_ms(lambda s: s[-1][1] - s[0][0]),
      "min span %.2f" % (min(s[-1][1] - s[0][0] for s in steps) / 1e6))
