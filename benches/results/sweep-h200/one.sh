#!/usr/bin/env bash
# One-GPU lease: the models' CUDA tests (TEST_FILTERS, .device/x2/tm.xz: the models' test binary, built with
# --no-default-features --features distributed,autotune), then run.sh here with RUNS (builds in .device/x2).
set -u
mkdir -p .device/b /tmp/w $OUT/tests
for f in .device/x2/*.xz; do ln -sf $(pwd)/$f .device/b/$(basename $f); done
nccl=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))")
export LD_LIBRARY_PATH=$nccl:${LD_LIBRARY_PATH:-}
t0=$(date +%s)
if [ -n "${TEST_FILTERS:-}" ]; then
  [ -x /tmp/w/tm ] || { xz -dc .device/x2/tm.xz > /tmp/w/tm && chmod +x /tmp/w/tm; }
  for f in $TEST_FILTERS; do
    ( cd models && BASTILE_TEST_RUNTIMES=cuda timeout ${WAIT:-200} /tmp/w/tm --test-threads 1 --nocapture $f > $OUT/tests/$f.log 2>&1; echo "rc $?" >> $OUT/tests/$f.log )
    grep -E "^test |test result|panicked|rc " $OUT/tests/$f.log | tail -12
  done
fi
echo "== tests took $(( $(date +%s) - t0 )) s"
[ -n "${RUNS:-}" ] && bash benches/results/sweep-h200/run.sh
echo "== end at $(( $(date +%s) - t0 )) s"
