#!/usr/bin/env bash
# The CUDA data-parallel test (NCCL over the GPUs there are); if it still runs after WAIT s,
# every thread's backtrace (cuda-gdb), then it is stopped.
set -u
mkdir -p $OUT
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LD_LIBRARY_PATH=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))"):${LD_LIBRARY_PATH:-}
[ -d /work/main ] || { mkdir -p /work && ln -s $PWD /work/main; }
w=/tmp/w; mkdir -p $w
b=${BIN:-tests-mdp}; [ -x $w/$b ] || { xz -dc .device/b/$b.xz > $w/$b && chmod +x $w/$b; }
cd $w
BASTILE_TEST_RUNTIMES=cuda ./$b ${TEST_FILTERS:-parallel::workers} --nocapture --test-threads 1 > $OUT/test.log 2>&1 &
pid=$!
for i in $(seq ${WAIT:-150}); do kill -0 $pid 2>/dev/null || break; sleep 1; done
if kill -0 $pid 2>/dev/null; then
  echo "still running after ${WAIT:-150} s: backtraces" >> $OUT/test.log
  timeout 120 cuda-gdb -batch -p $pid -ex "set pagination off" -ex "info threads" -ex "thread apply all bt 25" > $OUT/bt.txt 2>&1
  kill -9 $pid
fi
wait $pid; echo "rc $?" >> $OUT/test.log
tail -20 $OUT/test.log
