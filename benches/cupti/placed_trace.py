"""Reads a kernel trace written with KERNEL_TRACE_PLACE set
(`kernel_trace.c`: lines `K start end [dD sS] name`) as
`(start, end, device, stream, name)` tuples, sorted by start (ns), or any
trace as `(start, end, name)` tuples, and
finds a training step's window and the GPU's idle gaps in it (for any
trace's `(start, end, name)` kernels). A trace ending in `.xz` is read
compressed, as the results keep them."""
import lzma
import re
import sys

PLACE = re.compile(r"\[d(\d+) s(\d+)\] (.*)")


def lines(path):
    """The trace's lines, decompressed when it ends in `.xz`."""
    return lzma.open(path, "rt") if path.endswith(".xz") else open(path)


def read(path):
    kernels = []
    for line in lines(path):
        parts = line.rstrip("\n").split(" ", 3)
        if parts[0] != "K" or len(parts) < 4:
            continue
        place = PLACE.match(parts[3])
        if not place:
            sys.exit(f"{path}: no [dD sS] in the names: trace with KERNEL_TRACE_PLACE set")
        device, stream, name = place.groups()
        kernels.append((int(parts[1]), int(parts[2]), int(device), int(stream), name))
    kernels.sort()
    return kernels


def read_unplaced(path):
    """A trace's kernels as `(start, end, name)` tuples sorted by start
    (ns), whether or not it was written with KERNEL_TRACE_PLACE (the
    place, when there, stays in the name)."""
    kernels = []
    for line in lines(path):
        parts = line.rstrip("\n").split(" ", 3)
        if parts[0] == "K":
            kernels.append((int(parts[1]), int(parts[2]), parts[3] if len(parts) > 3 else ""))
    kernels.sort()
    return kernels


def last_whole_step(kernels):
    """`(start, end)` in ns of the second-to-last training step among
    `kernels` (`(start, end, name)`, sorted): a step runs from the end of
    one optimizer update (the last `adamw_kernel` launch before a pause of
    over 5 ms) to the end of the next. Exits when the trace holds fewer
    than two whole steps."""
    updates = [k for k in kernels if "adamw_kernel" in k[2]]
    ends = [
        k[1]
        for i, k in enumerate(updates)
        if i + 1 == len(updates) or updates[i + 1][0] - k[1] > 5e6
    ]
    if len(ends) < 3:
        sys.exit("fewer than two whole steps in the trace")
    return ends[-3], ends[-2]


def idle_gaps(kernels, start, end, min_gap_ns):
    """The GPU's idle gaps over `min_gap_ns` among `kernels` (`(start, end,
    name)`, sorted) that start between `start` and `end`: `(length, opened,
    closed, kernel before, kernel after)` each, in ns."""
    last, before, gaps = start, "(step start)", []
    for s, e, name in kernels:
        if not start < s <= end:
            continue
        if s - last > min_gap_ns:
            gaps.append((s - last, last, s, before, name))
        if e > last:
            last, before = e, name
    return gaps
