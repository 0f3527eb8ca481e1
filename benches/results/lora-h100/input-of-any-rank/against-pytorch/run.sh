#!/usr/bin/env bash
# Issue 35: LoRA r16 training steps of one build (BIN) against HF + PEFT and
# HF + Liger + PEFT (GPT-OSS: target_parameters too), in one
# lease. RUNS lists model:batch:seq; EXTRA adds bench flags.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt
w=/tmp/w; mkdir -p $w
bin=$w/${BIN:-bench-oss}; [ -x $bin ] || { xz -dc .device/b/${BIN:-bench-oss}.xz > $bin && chmod +x $bin; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
for run in ${RUNS:-gpt-oss-20b-4l:1:4096}; do
  IFS=: read model batch seq <<< "$run"
  d=/tmp/caches-${BIN:-bench-oss}; mkdir -p $d
  tag=$model-$batch-$seq
  ( cd $d && BASTILE_KERNEL_CACHE=$d/kernels CUDA_CACHE_PATH=$d/cuda XDG_CACHE_HOME=$d/xdg timeout ${BENCH_TIMEOUT:-240} $bin --runtime cuda \
      --model $model --batch $batch --seq $seq --lora 16 ${EXTRA-} --impl bastile --steps ${STEPS:-10} --no-cold-start \
      --out $R/bastile-$tag.json > $R/bastile-$tag.log 2>&1 )
  echo "rc $?" >> $R/bastile-$tag.log
  python3 -c "
import json
for r in json.load(open('$R/bastile-$tag.json'))['train']:
    print('bastile $tag', 'ms', round(r.get('ms_per_step') or 0, 1), 'host', round(r.get('host_ms') or 0, 1), 'in use', round(r.get('in_use_mib') or 0), 'first', round(r.get('first_step_s') or 0, 1), r.get('error'))" 2>&1 | tail -1
  tail -3 $R/bastile-$tag.log
  if [ -n "${TORCH_IMPLS:-hf liger}" ]; then
    PYTHONPATH=/tmp/site timeout ${TORCH_TIMEOUT:-250} python3 benches/python/train_torch.py --model $model --seq $seq --batch $batch --lora 16 \
        --impl ${TORCH_IMPLS:-hf liger} --steps ${STEPS:-10} --out $R/torch-$tag.jsonl > $R/torch-$tag.log 2>&1
    echo "rc $?" >> $R/torch-$tag.log
    python3 -c "
import json
for l in open('$R/torch-$tag.jsonl'):
    r = json.loads(l); print(r['implementation'], 'ms', round(r.get('ms_per_step') or 0, 1), 'in use', round(r.get('in_use_mib') or 0), r.get('error'))" 2>&1 | tail -3
  fi
done
tar -C $OUT -cJf $OUT/r.tar.xz r && rm -rf $R
