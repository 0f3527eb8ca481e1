#!/usr/bin/env bash
# Data-parallel over CUDA: the models' NCCL test (fusion and direct) and `bastile finetune --devices 2`.
set -u
R=$OUT/r; mkdir -p $R
nccl=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))")
export LD_LIBRARY_PATH=$nccl:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt
xz -dc .device/b/tests-models.xz > /tmp/tm && chmod +x /tmp/tm
xz -dc .device/b/bastile.xz > /tmp/bastile && chmod +x /tmp/bastile
ln -sfn $(pwd) /work/main 2>/dev/null
( cd models && BASTILE_TEST_RUNTIMES=cuda timeout ${WAIT:-200} /tmp/tm --test-threads 1 --nocapture workers_summing_gradients_train_as_one_worker_accumulating > $R/cuda-tests-models.log 2>&1; echo "rc $?" >> $R/cuda-tests-models.log ) &
T=$!
( cd /tmp && timeout 120 /tmp/bastile finetune --device cuda --model bastile-tiny --output /tmp/ft2 --steps 6 --devices 2 > $R/cli-devices-2.txt 2>&1; echo "rc $?" >> $R/cli-devices-2.txt )
wait $T
grep -E "^test |test result|panicked|NCCL over|rc " $R/cuda-tests-models.log | tail -12
tail -6 $R/cli-devices-2.txt
tar -C $OUT -cJf $OUT/r-${TAG:-dp4}.tar.xz r && rm -rf $R
