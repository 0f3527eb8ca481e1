"""Where a first training step's time goes, from a log whose lines carry
seconds since the process started (`coldstart.sh` stamps them) and
CubeCL's compilation log (`[compilation.logger] level = "basic"`): each
compiled kernel is charged the time until the next line, which on a fresh
machine is its NVRTC compilation and the driver's load of the PTX (or, for
an autotuned kernel, its candidates' benchmark runs).

Usage: python3 compile_timeline.py LOG [LOG ...]
"""

import collections
import re
import sys

STAMPED = re.compile(r"\s*([\d.]+)\s+(.*)")
COMPILING = "[Compiling kernel]"


def timeline(path):
    events = []
    with open(path) as f:
        for line in f:
            m = STAMPED.match(line)
            if m:
                events.append((float(m.group(1)), m.group(2)))
    families = collections.defaultdict(lambda: [0, 0.0])
    for (t, text), (t_next, _) in zip(events, events[1:]):
        if COMPILING in text:
            name = text.split(COMPILING, 1)[1].strip().split("::")[-1]
            families[name][0] += 1
            families[name][1] += t_next - t
    first_step = next((t for t, text in events if re.search(r"\bstep 0:", text)), None)
    return families, first_step


def main(paths):
    for path in paths:
        families, first_step = timeline(path)
        count = sum(n for n, _ in families.values())
        seconds = sum(s for _, s in families.values())
        print(f"## {path}")
        done = f"{first_step:.1f} s" if first_step is not None else "not reached"
        print(f"first step done {done} after the process started; "
              f"{count} kernels compiled, {seconds:.1f} s charged to them\n")
        print("| kernel | compiled | s |")
        print("|---|---:|---:|")
        for name, (n, s) in sorted(families.items(), key=lambda kv: -kv[1][1]):
            print(f"| {name} | {n} | {s:.2f} |")
        print()


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
