#!/usr/bin/env bash
# Data-parallel lease on a multi-GPU machine: PARTS (in order) of tests (the models'
# NCCL tests, with thread backtraces if one hangs), sweep (data-parallel-h100x2/run.sh),
# ddp (HF + Liger-Kernel under PyTorch DDP). Builds in .device/x2; results under $OUT.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nccl=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))")
export LD_LIBRARY_PATH=$nccl:${LD_LIBRARY_PATH:-}
mkdir -p .device/b /tmp/w
for f in .device/x2/*.xz; do ln -sf $(pwd)/$f .device/b/$(basename $f); done
t0=$(date +%s)
for part in ${PARTS:-tests sweep}; do
  echo "== $part at $(( $(date +%s) - t0 )) s"
  case $part in
  tests)
    R=$OUT/tests; mkdir -p $R
    [ -x /tmp/w/tm ] || { xz -dc .device/x2/tm.xz > /tmp/w/tm && chmod +x /tmp/w/tm; }
    for f in ${TEST_FILTERS:-during_the_backward after_the_backward}; do
      ( cd models && BASTILE_TEST_RUNTIMES=cuda RUST_BACKTRACE=1 /tmp/w/tm --test-threads 1 --nocapture $f > $R/$f.log 2>&1 ) &
      pid=$!
      for i in $(seq ${WAIT:-150}); do kill -0 $pid 2>/dev/null || break; sleep 1; done
      if kill -0 $pid 2>/dev/null; then
        echo "still running after ${WAIT:-150} s: backtraces" >> $R/$f.log
        tp=$(pgrep -f "/tmp/w/tm --test-threads" | head -1)
        timeout 100 cuda-gdb -batch -p $tp -ex "set pagination off" -ex "info threads" -ex "thread apply all bt 30" > $R/bt-$f.txt 2>&1
        kill -9 $tp; fi
      wait $pid; echo "rc $?" >> $R/$f.log
      grep -E "^test |test result|panicked|cuda|rc |still" $R/$f.log | tail -14
    done ;;
  sweep)
    NEW=${BIN:-bench-x} BUILDS=${BIN:-bench-x} DEVS=${DEVS:-1,2} TRACES=${TRACES-} TAG=${TAG:-s} BENCH_TIMEOUT=300 \
      bash benches/results/data-parallel-h100x2/run.sh 2>&1 | grep -v "^Training step\|^| model\|^Data-parallel scaling" ;;
  ddp)
    R=$OUT/ddp; mkdir -p $R
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    for run in ${DDP_RUNS:-llama-3.2-1b:1 llama-3.2-1b:2 qwen3-1.7b:1 qwen3-1.7b:2}; do
      IFS=: read model n <<< "$run"
      ( cd benches/python && PYTHONPATH=/tmp/site timeout ${DDP_TIMEOUT:-200} torchrun --standalone --nproc_per_node $n train_ddp.py \
          --model $model --seq 4096 --impl liger --steps ${DDP_STEPS:-10} >> $R/ddp-liger.jsonl 2>> $R/ddp-liger.log ); echo "rc $? $run" >> $R/ddp-liger.log
      tail -1 $R/ddp-liger.jsonl; echo
    done ;;
  esac
done
echo "== end at $(( $(date +%s) - t0 )) s"
