#!/usr/bin/env bash
# The models' data-parallel tests over NCCL (fusion: sums after the backward pass; direct: during it).
set -u
R=$OUT/tests; mkdir -p $R
nccl=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))")
xz -dc .device/dp/tests-models.xz > /tmp/tm && chmod +x /tmp/tm
nvidia-smi --query-gpu=name --format=csv,noheader > $R/gpus.txt
cd models
NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=$nccl:${LD_LIBRARY_PATH:-} BASTILE_TEST_RUNTIMES=cuda timeout ${TWAIT:-300} /tmp/tm --test-threads 1 --nocapture parallel > $R/cuda-tests-models.log 2>&1
echo "rc $?" >> $R/cuda-tests-models.log
grep -E "^test |test result|panicked|cuda|rc " $R/cuda-tests-models.log | tail -20
