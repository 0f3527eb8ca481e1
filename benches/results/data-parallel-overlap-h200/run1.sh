#!/usr/bin/env bash
# x2 lease: data-parallel sweep of NEW (segmented sums) and OLD (the build before), 1 and 2 GPUs.
set -u
mkdir -p .device/b
for f in .device/dp/*.xz; do ln -sf $(pwd)/$f .device/b/$(basename $f); done
nvidia-smi --query-gpu=name,memory.total --format=csv
NEW=${NEW:-bench-seg} OLD=${OLD:-bench-e} DEVS=${DEVS:-1,2} TRACES=${TRACES-} TAG=${TAG:-x2a} BENCH_TIMEOUT=${BENCH_TIMEOUT:-280} \
  bash benches/results/data-parallel-h100x2/run.sh
