"""Reads a kernel trace written with KERNEL_TRACE_PLACE set
(`kernel_trace.c`: lines `K start end [dD sS] name`) as
`(start, end, device, stream, name)` tuples, sorted by start (ns)."""
import re
import sys

PLACE = re.compile(r"\[d(\d+) s(\d+)\] (.*)")


def read(path):
    kernels = []
    for line in open(path):
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
