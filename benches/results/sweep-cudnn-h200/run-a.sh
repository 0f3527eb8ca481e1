#!/usr/bin/env bash
# Call A: Bastile's sweep (both models, batch 1 and 4, 1024-8192), then PyTorch rows as time allows.
mkdir -p .device/b; cp .device/sw/bench-m.xz .device/b/ 2>/dev/null
export BUILDS=bench-m SWEEP_STEPS=10 BENCH_TIMEOUT=250 TSTEPS=10
RUNS="sweep:bench-m:qwen3-0.6b:1024,2048,4096,8192 sweep:bench-m:llama-3.2-1b:1024,2048,4096,8192 ${EXTRA:-}" timeout ${LIMIT:-580} bash benches/results/sweep-h200/run.sh
