#!/usr/bin/env bash
# A fresh machine's first training step with each op's default launch
# configuration (no tuning), per model; then the steady step with and
# without full tuning, in the same lease. Every log line is stamped with
# seconds since its process started; CubeCL logs each kernel it compiles.
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
cat > cubecl.toml <<TOML
[compilation.logger]
level = "basic"
stderr = true
[autotune.logger]
level = "minimal"
stderr = true
TOML
bench() { local name=$1; shift; ( ./bench --runtime cuda --batch 1 --impl bastile --out "$work/$name.json" "$@" ) 2>&1 | stamp > "$work/$name.log"; grep -E "^ *[0-9.]+ +\| [a-z]" "$work/$name.log" | tail -1; }
# Caches of compiled kernels, of the driver's JIT and of CubeCL's autotune
# results, fresh for each cold run.
fresh() { export BASTILE_KERNEL_CACHE=/tmp/kernels-$1 CUDA_CACHE_PATH=/tmp/nv-$1; rm -rf ~/.cache/cubecl; }
fresh qwen;  bench cold-qwen3-4096 --model qwen3-0.6b --seq 4096 --steps 3
bench warm-qwen3-4096 --model qwen3-0.6b --seq 4096 --steps 3
bench newlen-qwen3-6144 --model qwen3-0.6b --seq 6144 --steps 3
fresh llama; bench cold-llama-4096 --model llama-3.2-1b --seq 4096 --steps 3
bench warm-llama-4096 --model llama-3.2-1b --seq 4096 --steps 3
fresh oss;   bench cold-gptoss4l-4096 --model gpt-oss-20b-4l --seq 4096 --steps 3
bench warm-gptoss4l-4096 --model gpt-oss-20b-4l --seq 4096 --steps 3
# Steady step: full tuning against the defaults, Qwen3-0.6B at 4096,
# on the qwen caches (the tuned run compiles the other candidates).
export BASTILE_KERNEL_CACHE=/tmp/kernels-qwen CUDA_CACHE_PATH=/tmp/nv-qwen
BASTILE_TUNE=full bench tune-qwen3-4096 --model qwen3-0.6b --seq 4096 --steps 3
for r in 1 2; do
  bench steady-defaults-$r --model qwen3-0.6b --seq 4096 --steps 20
  BASTILE_TUNE=full bench steady-full-$r --model qwen3-0.6b --seq 4096 --steps 20
done
tar -C "$work" -cJf "$OUT/logs.tar.xz" --exclude bench --exclude cubecl.toml .
du -sh /tmp/kernels-* /tmp/nv-* > "$OUT/cache-sizes.txt" 2>&1
