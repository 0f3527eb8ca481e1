#!/usr/bin/env bash
# The bastile CUDA test binary, modules as arguments.
set -u
mkdir -p $OUT/r; xz -dc .device/b/tests-bastile.xz > /tmp/tb && chmod +x /tmp/tb
printf '[compilation]\ncheck_mode = "validate"\n' > /tmp/cubecl.toml
cd /tmp && BASTILE_TEST_RUNTIMES=cuda timeout ${WAIT:-420} /tmp/tb --test-threads 2 "$@" > $OUT/r/cuda-tests.log 2>&1; echo "rc $?" >> $OUT/r/cuda-tests.log
grep -E "^test |test result|panicked|rc " $OUT/r/cuda-tests.log | tail -30
