#!/usr/bin/env bash
# Final build: the data-parallel sweep RUNS times (DEVS GPUs), then the models' CUDA data-parallel tests (NCCL).
set -u
mkdir -p .device/b
for f in .device/dp/*.xz; do ln -sf $(pwd)/$f .device/b/$(basename $f); done
for i in $(seq 1 ${RUNS:-2}); do
  NEW=bench-ts BUILDS=bench-ts DEVS=${DEVS:-1,2} TRACES=${TRACES-} TRACE_MODEL=llama-3.2-1b TAG=${TAG:-x2d}-$i BENCH_TIMEOUT=300 \
    bash benches/results/data-parallel-h100x2/run.sh 2>&1 | grep -v "^Training step\|^| model\|^Data-parallel scaling"
done
if [ -f .device/dp/tests-models.xz ]; then
  R=$OUT/tests; mkdir -p $R
  nccl=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))")
  xz -dc .device/dp/tests-models.xz > /tmp/tm && chmod +x /tmp/tm
  ( cd models && NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=$nccl:${LD_LIBRARY_PATH:-} BASTILE_TEST_RUNTIMES=cuda timeout ${TWAIT:-240} /tmp/tm --test-threads 1 parallel > $R/cuda-tests-models.log 2>&1; echo "rc $?" >> $R/cuda-tests-models.log )
  grep -E "^test |test result|panicked|NCCL over|rc " $R/cuda-tests-models.log | tail -12
fi
