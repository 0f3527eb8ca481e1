#!/usr/bin/env bash
# Issue 29/35: the LoRA layer taking its input of any rank (no reshape
# nodes around it; bench-lr) against the build before (bench-oss), LoRA r16,
# alternating in one lease, each on caches of its own; then the CUDA tests
# of the LoRA and linear ops (TEST_FILTERS).
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt
w=/tmp/w; mkdir -p $w
for b in bench-oss bench-lr tests-lr; do
  [ -x $w/$b ] || { [ -f .device/b/$b.xz ] && xz -dc .device/b/$b.xz > $w/$b && chmod +x $w/$b; }
done
for run in ${RUNS:-lr:qwen3-0.6b:4:2048 oss:qwen3-0.6b:4:2048 oss:qwen3-0.6b:4:2048 lr:qwen3-0.6b:4:2048}; do
  IFS=: read build model batch seq <<< "$run"
  d=/tmp/caches-$build; mkdir -p $d
  tag=$build-$model-$batch-$seq; n=1; while [ -f $R/$tag-$n.json ]; do n=$((n+1)); done; tag=$tag-$n
  ( cd $d && BASTILE_KERNEL_CACHE=$d/kernels CUDA_CACHE_PATH=$d/cuda XDG_CACHE_HOME=$d/xdg timeout 200 $w/bench-$build --runtime cuda \
      --model $model --batch $batch --seq $seq --lora 16 --impl bastile --steps ${STEPS:-10} --no-cold-start \
      --out $R/$tag.json > $R/$tag.log 2>&1 )
  echo "rc $?" >> $R/$tag.log
  python3 -c "
import json
for r in json.load(open('$R/$tag.json'))['train']:
    print('$tag', 'ms', round(r.get('ms_per_step') or 0, 1), 'host', round(r.get('host_ms') or 0, 1), 'in use', round(r.get('in_use_mib') or 0), 'first', round(r.get('first_step_s') or 0, 1), r.get('error'))" 2>&1 | tail -1
done
if [ -n "${TEST_FILTERS:-}" ]; then
  ( cd $w && BASTILE_TEST_RUNTIMES=cuda timeout ${TEST_TIMEOUT:-250} ./tests-lr $TEST_FILTERS 2>&1 ) > $R/tests.log
  echo "rc $?" >> $R/tests.log; grep -E "^test |^test result|rc " $R/tests.log | tail -6
fi
tar -C $OUT -cJf $OUT/r.tar.xz r && rm -rf $R
