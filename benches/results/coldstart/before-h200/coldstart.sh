#!/usr/bin/env bash
# Where a fresh machine's first training step spends its time: CubeCL's
# compilation log (one line a kernel compiled) and autotune log, every
# line stamped with seconds since the process started.
# Usage: coldstart.sh (results under $OUT)
set -u
here="$(cd "$(dirname "$0")" && pwd)"
work=/tmp/cs; rm -rf "$work"; mkdir -p "$work"; cd "$work"
xz -dc "$here/bastile-bench.xz" > bench && chmod +x bench
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
stamp() { python3 -u -c '
import sys, time
t0 = time.time()
for line in sys.stdin:
    print(f"{time.time() - t0:8.3f}  {line}", end="", flush=True)'; }
logs() { cat > cubecl.toml <<TOML
[compilation.logger]
level = "basic"
stderr = true
[autotune.logger]
level = "${1:-full}"
stderr = true
TOML
}
bench() { local name=$1; shift; ( ./bench --runtime cuda --batch 1 --impl bastile --steps 3 --out "$work/$name.json" "$@" ) 2>&1 | stamp > "$work/$name.log"; tail -5 "$work/$name.log"; }
export BASTILE_KERNEL_CACHE=/tmp/kernels-a
logs full
bench cold-qwen3-4096 --model qwen3-0.6b --seq 4096
bench warm-qwen3-4096 --model qwen3-0.6b --seq 4096
bench newlen-qwen3-3072 --model qwen3-0.6b --seq 3072
# No Bastile tuning (each op's first candidate), fresh kernel, autotune and driver caches.
mv ~/.cache/cubecl ~/.cache/cubecl-full 2>/dev/null
export BASTILE_KERNEL_CACHE=/tmp/kernels-b CUDA_CACHE_PATH=/tmp/nv-b BASTILE_TUNE_CANDIDATES=1
bench first-candidate-qwen3-4096 --model qwen3-0.6b --seq 4096
unset BASTILE_TUNE_CANDIDATES
tar -C "$work" -cJf "$OUT/logs.tar.xz" --exclude bench --exclude cubecl.toml .
tar -C ~/.cache -cJf "$OUT/autotune-cache.tar.xz" cubecl-full cubecl 2>/dev/null
du -sh /tmp/kernels-a /tmp/kernels-b > "$OUT/cache-sizes.txt" 2>&1
ls ~/.nv 2>/dev/null >> "$OUT/cache-sizes.txt"
