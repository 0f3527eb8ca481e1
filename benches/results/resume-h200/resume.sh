#!/usr/bin/env bash
# Resume cost on a GPU: a fresh run that saves a checkpoint, the run resumed
# from it, and a new run from the checkpoint's weights; every stderr line
# stamped with seconds since its process started.
set -u
cd "$(dirname "$0")"
xz -dkf bastile.xz && chmod +x bastile
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
export BASTILE_KERNEL_CACHE=/tmp/bastile-kernels
stamp() { python3 -u -c '
import sys, time
t0 = time.time()
for line in sys.stdin:
    print(f"{time.time() - t0:8.2f}  {line}", end="", flush=True)'; }
common=(--tokenizer tok/tokenizer.json --steps 4 --save-every 2 --log-every 1 --batch-size 8 --max-seq 1024)
run() { local name=$1; shift; ( /usr/bin/time -v ./bastile finetune "$@" "${common[@]}" ) 2>&1 | stamp | tee "$OUT/$name.txt"; }
run fresh --model "${MODEL:-qwen3-0.6b}" --output /tmp/a
run resumed --resume /tmp/a/checkpoint-2 --output /tmp/a
run from-checkpoint --model /tmp/a/checkpoint-2 --output /tmp/b
du -ab /tmp/a/checkpoint-2 > "$OUT/checkpoint-sizes.txt"
