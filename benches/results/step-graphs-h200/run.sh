#!/usr/bin/env bash
# One lease: Bastile's training step plainly and recorded as CUDA graphs
# (`--step-graphs`), alternating, then the PyTorch rows (HF with SDPA, HF
# under torch.compile; AdamW(fused=True), clip_grad_norm_(1.0)) at the
# same shapes. env: X (the carried folder), B (the build), RUNS of
# "batch:seq:model", ROUNDS, TORCH ("" to leave PyTorch out).
set -u
R=$OUT/r; mkdir -p $R
X=${X:-.device/g}; B=${B:-bench-g}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt
w=/tmp/w; mkdir -p $w
[ -x $w/$B ] || { xz -dc $X/$B.xz > $w/$B && chmod +x $w/$B; }
lib=$(dirname $(find /usr/local -name 'libcupti.so*' | head -1)); export LD_LIBRARY_PATH=$lib:${LD_LIBRARY_PATH:-}
d=/tmp/caches-$B; mkdir -p $d
t0=$(date +%s)
for round in ${ROUNDS:-1}; do
  for run in ${RUNS:-1:2048:qwen3-0.6b 4:1024:qwen3-0.6b}; do
    IFS=: read batch seq model <<< "$run"
    for mode in plain graphs; do
      flag=""; [ $mode = graphs ] && flag=--step-graphs
      tag=$round-$model-$batch-$seq-$mode
      ( cd $d && BASTILE_KERNEL_CACHE=$d/kernels CUDA_CACHE_PATH=$d/cuda XDG_CACHE_HOME=$d/xdg timeout ${BENCH_TIMEOUT:-300} \
        $w/$B --runtime cuda --model $model --seq $seq --batch $batch --impl bastile --steps ${STEPS:-20} --no-cold-start $flag \
        --out $R/$tag.json ) > $R/$tag.log 2>&1
      echo "rc $?" >> $R/$tag.log
      echo "== $tag at $(( $(date +%s) - t0 )) s"; grep -E "^\| $model|error|panick|replayed|not recorded" $R/$tag.log | head -4
    done
  done
done
for run in ${TORCH-1:2048:qwen3-0.6b 4:1024:qwen3-0.6b}; do
  IFS=: read batch seq model <<< "$run"
  tag=torch-$model-$batch-$seq
  timeout ${TORCH_TIMEOUT:-300} python3 benches/python/train_torch.py --model $model --seq $seq --batch $batch \
    --impl ${TORCH_IMPLS:-hf compile} --steps ${TSTEPS:-10} --out $R/$tag.jsonl > $R/$tag.log 2>&1; echo "rc $?" >> $R/$tag.log
  echo "== $tag at $(( $(date +%s) - t0 )) s"
  python3 -c "
import json
for l in open('$R/$tag.jsonl'):
    r = json.loads(l); print('$tag', r['implementation'], 'ms', round(r.get('ms_per_step') or 0, 1), 'in use', round(r.get('in_use_mib') or 0), r.get('error'))" 2>&1 | tail -3
done
tar -C $OUT -cJf $OUT/r-${TAG:-graphs}.tar.xz r && rm -rf $R
