#!/usr/bin/env bash
# The fused AdamW's kernel written four ways, each in a fresh process with
# a fresh kernel cache: its compile time (CubeCL's compilation log, lines
# stamped) and the optimizer step of Qwen3-0.6B's parameters.
set -u
here="$(cd "$(dirname "$0")" && pwd)"
work=/tmp/av; rm -rf "$work"; mkdir -p "$work"; cd "$work"
xz -dc "$here/bastile-bench-variants.xz" > bench && chmod +x bench
nvidia-smi --query-gpu=name --format=csv > "$OUT/gpu.txt"
stamp() { python3 -u -c '
import sys, time
t0 = time.time()
for line in sys.stdin:
    print(f"{time.time() - t0:8.3f}  {line}", end="", flush=True)'; }
printf '[compilation.logger]\nlevel = "basic"\nstderr = true\n' > cubecl.toml
for v in direct-unroll:32 direct-unroll:8 direct:8 direct:32 select:32 select-unroll:32 direct-unroll:16 direct:16; do
  name=${v%%:*}; slots=${v##*:}
  export BASTILE_KERNEL_CACHE=/tmp/k-$name-$slots CUDA_CACHE_PATH=/tmp/nv-$name-$slots
  BASTILE_ADAMW_VARIANT=$name BASTILE_ADAMW_SLOTS=$slots ./bench --runtime cuda --op adamw 2>&1 | stamp > "$work/$name-$slots.log"
  python3 - "$work/$name-$slots.log" "$name:$slots" <<'PY'
import re, sys
ev = [(float(m.group(1)), m.group(2)) for l in open(sys.argv[1]) for m in [re.match(r"\s*([\d.]+)\s+(.*)", l)] if m]
comp = sum(b[0] - a[0] for a, b in zip(ev, ev[1:]) if "AdamwKernel" in a[1] or "SumSquaresKernel" in a[1])
ms = [l for t, l in ev if "| adamw" in l and "bastile" in l]
print(sys.argv[2], f"adamw+sum_squares compile {comp:.1f} s;", ms[-1] if ms else "no result")
PY
done | tee "$OUT/summary.txt"
tar -C "$work" -cJf "$OUT/logs.tar.xz" --exclude bench --exclude cubecl.toml .
