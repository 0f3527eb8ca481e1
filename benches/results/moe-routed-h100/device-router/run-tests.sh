#!/usr/bin/env bash
# CUDA tests of a test binary (BIN) with filters (TEST_FILTERS).
set -u
mkdir -p $OUT
w=/tmp/w; mkdir -p $w
b=${BIN:-tests-rt}; [ -x $w/$b ] || { xz -dc .device/b/$b.xz > $w/$b && chmod +x $w/$b; }
( cd $w && BASTILE_TEST_RUNTIMES=cuda timeout ${TEST_TIMEOUT:-500} ./$b $TEST_FILTERS 2>&1 ) > $OUT/tests-${TAG:-a}.log
echo "rc $?" >> $OUT/tests-${TAG:-a}.log
grep -E "^test |^test result|rc |panicked|FAILED" $OUT/tests-${TAG:-a}.log | tail -30
