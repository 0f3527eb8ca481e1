#!/usr/bin/env bash
# A/B of builds on the step (RUNS in the environment), through the sweep lease script.
mkdir -p .device/b; for f in .device/sw*/bench-*.xz; do cp -n $f .device/b/; done
export BUILDS="${BUILDS:-bench-m bench-b}" SWEEP_STEPS=10 BENCH_TIMEOUT=200 TSTEPS=10
timeout ${LIMIT:-585} bash benches/results/sweep-h200/run.sh
