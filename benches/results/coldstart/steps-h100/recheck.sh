#!/usr/bin/env bash
# The optimizer step alone and two training steps, with this code, to
# compare with the README's figures of the code before.
set -u
here="$(cd "$(dirname "$0")" && pwd)"
work=/tmp/rc; rm -rf "$work"; mkdir -p "$work/out"; cd "$work"
xz -dc "$here/bastile-bench.xz" > bench && chmod +x bench
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$work/out/gpu.txt"
export BASTILE_KERNEL_CACHE=/tmp/kernels
o=$work/out
./bench --runtime cuda --op adamw --out "$o/adamw.json" > "$o/adamw.log" 2>&1; grep "| adamw" "$o/adamw.log" | tail -2
./bench --runtime cuda --model qwen3-0.6b --seq 2048 --batch 1 --impl bastile --steps 20 --out "$o/qwen3-2048.json" > "$o/qwen3-2048.log" 2>&1; grep "| qwen3" "$o/qwen3-2048.log" | tail -1
./bench --runtime cuda --model llama-3.2-1b --seq 4096 --batch 1 --impl bastile --steps 20 --out "$o/llama-4096.json" > "$o/llama-4096.log" 2>&1; grep "| llama" "$o/llama-4096.log" | tail -1
tar -C "$o" -cJf "$OUT/steps.tar.xz" .
