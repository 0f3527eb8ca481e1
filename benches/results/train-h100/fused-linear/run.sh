#!/usr/bin/env bash
# Issue 29: plain projections as one fused node (bastile::linear, bench-lin)
# against the build before it (bench-new), full finetuning, in one lease,
# alternating; then the linear test on CUDA. RUNS lists build:model:batch:seq.
set -u
root="$PWD"
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt
w=/tmp/w; mkdir -p $w
for b in bench-new bench-lin tests-burn; do
  [ -x $w/$b ] || { [ -f .device/b/$b.xz ] && xz -dc .device/b/$b.xz > $w/$b && chmod +x $w/$b; }
done
for run in ${RUNS:-lin:qwen3-0.6b:1:2048 new:qwen3-0.6b:1:2048 new:llama-3.2-1b:1:4096 lin:llama-3.2-1b:1:4096}; do
  IFS=: read build model batch seq <<< "$run"
  d=/tmp/caches-$build; mkdir -p $d
  tag=$build-$model-$batch-$seq; n=1; while [ -f $R/$tag-$n.json ]; do n=$((n+1)); done; tag=$tag-$n
  ( cd $d && BASTILE_KERNEL_CACHE=$d/kernels CUDA_CACHE_PATH=$d/cuda XDG_CACHE_HOME=$d/xdg timeout 200 $w/bench-$build --runtime cuda \
      --model $model --batch $batch --seq $seq --impl bastile --steps ${STEPS:-10} --no-cold-start \
      --out $R/$tag.json > $R/$tag.log 2>&1 )
  echo "rc $?" >> $R/$tag.log
  python3 -c "
import json
for r in json.load(open('$R/$tag.json'))['train']:
    print('$tag', 'ms', round(r.get('ms_per_step') or 0, 1), 'host', round(r.get('host_ms') or 0, 1), 'in use', round(r.get('in_use_mib') or 0), 'first', round(r.get('first_step_s') or 0, 1), r.get('error'))" 2>&1 | tail -1
done
if [ -n "${TORCH:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  IFS=: read model batch seq <<< "$TORCH"
  PYTHONPATH=/tmp/site timeout ${TORCH_TIMEOUT:-250} python3 benches/python/train_torch.py --model $model --seq $seq --batch $batch \
      --impl ${TORCH_IMPLS:-hf liger compile} --steps ${STEPS:-10} --out $R/torch-$model-$batch-$seq.jsonl > $R/torch-$model-$batch-$seq.log 2>&1
  echo "rc $?" >> $R/torch-$model-$batch-$seq.log
  python3 -c "
import json
for l in open('$R/torch-$model-$batch-$seq.jsonl'):
    r = json.loads(l); print(r['implementation'], 'ms', round(r.get('ms_per_step') or 0, 1), 'in use', round(r.get('in_use_mib') or 0), r.get('error'))" 2>&1 | tail -3
fi
if [ -n "${TEST_FILTERS:-}" ]; then
  ( cd $w && BASTILE_TEST_RUNTIMES=cuda timeout ${TEST_TIMEOUT:-200} ./tests-burn $TEST_FILTERS 2>&1 ) > $R/tests.log
  echo "rc $?" >> $R/tests.log; grep -E "^test |^test result|rc " $R/tests.log | tail -5
fi
tar -C $OUT -cJf $OUT/r.tar.xz r && rm -rf $R
