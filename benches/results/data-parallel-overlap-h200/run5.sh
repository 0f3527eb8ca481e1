#!/usr/bin/env bash
# The models' NCCL data-parallel test with its output, and thread stacks if it hangs.
set -u
R=$OUT/tests; mkdir -p $R
nccl=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))")
xz -dc .device/dp/tests-models.xz > /tmp/tm && chmod +x /tmp/tm
cd models
NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=$nccl:${LD_LIBRARY_PATH:-} BASTILE_TEST_RUNTIMES=cuda RUST_BACKTRACE=1 /tmp/tm --test-threads 1 --nocapture workers_summing_gradients_train_as_one_worker_accumulating > $R/nccl-test.log 2>&1 &
P=$!
for i in $(seq 1 ${TWAIT:-150}); do sleep 1; kill -0 $P 2>/dev/null || break; done
if kill -0 $P 2>/dev/null; then
  echo "still running after ${TWAIT:-150} s" >> $R/nccl-test.log
  which gdb && gdb -p $P -batch -ex "thread apply all bt 25" > $R/stacks.txt 2>&1
  which gdb >/dev/null || { for t in /proc/$P/task/*; do echo "$t $(cat $t/comm) $(cat $t/wchan)"; done > $R/stacks.txt; }
  kill -9 $P
fi
wait $P; echo "rc $?" >> $R/nccl-test.log
tail -25 $R/nccl-test.log
grep -c "" $R/stacks.txt 2>/dev/null
