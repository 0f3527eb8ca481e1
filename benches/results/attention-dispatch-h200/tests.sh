#!/usr/bin/env bash
# CUDA test binaries: every .device/b/tests-*.xz, in parallel, logs under $OUT/t.
set -u
T=$OUT/t; mkdir -p $T /tmp/tt /work; ln -sfn $(pwd) /work/main
for f in .device/b/tests-*.xz; do
  n=$(basename $f .xz); xz -dc $f > /tmp/tt/$n && chmod +x /tmp/tt/$n
  ( cd /tmp && BASTILE_TEST_RUNTIMES=cuda timeout ${WAIT:-500} /tmp/tt/$n --test-threads ${TT:-2} ${FILTER:-} > $T/$n.log 2>&1; echo "rc $?" >> $T/$n.log ) &
done
wait
for f in $T/*.log; do echo "== $f"; grep -E "test result|panicked|FAILED|rc " $f | tail -8; done
