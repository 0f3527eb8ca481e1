#!/usr/bin/env bash
set -u
R=$OUT/xp; mkdir -p $R
nccl=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))")
xz -dc .device/dp/tests-models.xz > /tmp/tm && chmod +x /tmp/tm
cd models
for v in "XP_OWN=1 XP_EAGER=1" "XP_OWN=1" "XP_EAGER=1" "XP_NONE=1"; do
  tag=$(echo $v | tr ' =' '__')
  env $v NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=$nccl:${LD_LIBRARY_PATH:-} BASTILE_TEST_RUNTIMES=cuda timeout ${TWAIT:-80} /tmp/tm --test-threads 1 --nocapture workers_summing_gradients_train_as_one_worker_accumulating > $R/$tag.log 2>&1
  echo "== $v rc $?"; grep -E "cuda|test result|panicked" $R/$tag.log | tail -8
done
