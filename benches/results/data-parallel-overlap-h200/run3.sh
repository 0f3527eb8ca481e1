#!/usr/bin/env bash
# x2: sweeps of NEW (hand-over streams) and OLD, a trace of NEW (Llama, 2 GPUs), NEW with fewer NCCL channels.
set -u
mkdir -p .device/b
for f in .device/dp/*.xz; do ln -sf $(pwd)/$f .device/b/$(basename $f); done
NEW=${NEW:-bench-hs} OLD=${OLD:-bench-seg} DEVS=${DEVS:-1,2} TRACES=${TRACES-bench-hs:2} TRACE_MODEL=llama-3.2-1b TAG=${TAG:-x2c} BENCH_TIMEOUT=280 \
  bash benches/results/data-parallel-h100x2/run.sh
for ch in ${CHANNELS-8}; do
  R=$OUT/ch$ch; mkdir -p $R
  d=/tmp/caches-bench-hs
  ( cd $d && NCCL_NVLS_ENABLE=0 NCCL_MAX_NCHANNELS=$ch LD_LIBRARY_PATH=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))"):${LD_LIBRARY_PATH:-} \
    BASTILE_KERNEL_CACHE=$d/kernels CUDA_CACHE_PATH=$d/cuda XDG_CACHE_HOME=$d/xdg timeout 200 /tmp/w/bench-hs --runtime cuda --model llama-3.2-1b,qwen3-1.7b --seq 4096 --batch 1 --impl bastile --devices 2 --steps 10 --no-cold-start --out $R/ch.json > $R/ch.log 2>&1 )
  echo "== NCCL_MAX_NCHANNELS=$ch"; grep -A6 "Data-parallel scaling" $R/ch.md 2>/dev/null | grep "|" | tail -3
done
