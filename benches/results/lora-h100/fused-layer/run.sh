#!/usr/bin/env bash
# Issue 35: the fused LoRA layer (bastile::lora_linear) on CUDA: its tests
# (cuBLASLt's scaled and accumulating products), then LoRA r16 training
# steps of this code (bench-new) and the code before it (bench-pre), each
# on caches of its own, and HF + PEFT / HF + Liger-Kernel + PEFT, in one
# lease. MODELS, BATCH, SEQ, TORCH_IMPLS, OLD, TESTS select the work.
set -u
root="$PWD"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
R=$OUT/r; mkdir -p $R
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" > $R/versions.txt 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> $R/versions.txt
w=/tmp/w; mkdir -p $w
for b in bench-new bench-pre tests-burn; do
  [ -x $w/$b ] || { [ -f .device/b/$b.xz ] && xz -dc .device/b/$b.xz > $w/$b && chmod +x $w/$b; }
done
if [ "${TESTS:-1}" = 1 ]; then
  ( cd $w && BASTILE_TEST_RUNTIMES=cuda timeout ${TEST_TIMEOUT:-200} ./tests-burn ${TEST_FILTERS:-lora::} 2>&1 ) > $R/tests.log
  echo "rc $?" >> $R/tests.log; grep -E "^test result|FAILED|panicked" $R/tests.log
fi
bench() { local build=$1 model=$2
  d=/tmp/caches-$build; mkdir -p $d
  ( cd $d && BASTILE_KERNEL_CACHE=$d/kernels CUDA_CACHE_PATH=$d/cuda XDG_CACHE_HOME=$d/xdg timeout 250 $w/bench-$build --runtime cuda \
      --model $model --batch ${BATCH:-4} --seq ${SEQ:-2048} --lora 16 --impl bastile --steps ${STEPS:-10} --no-cold-start \
      --out $R/bastile-$build-$model.json > $R/bastile-$build-$model.log 2>&1 )
  echo "rc $?" >> $R/bastile-$build-$model.log
  python3 -c "
import json
for r in json.load(open('$R/bastile-$build-$model.json'))['train']:
    print('$build', r['model'], r['batch'], r['seq'], 'ms', r.get('ms_per_step'), 'host', r.get('host_ms'), 'in use', r.get('in_use_mib'), 'first', r.get('first_step_s'), r.get('error'))" 2>&1 | tail -2
}
for m in ${MODELS:-qwen3-0.6b llama-3.2-1b}; do
  [ "${NEW:-1}" = 1 ] && bench new $m
  [[ " ${OLD:-qwen3-0.6b} " == *" $m "* ]] && bench pre $m
  timeout ${TORCH_TIMEOUT:-200} python3 benches/python/train_torch.py --model $m --seq ${SEQ:-2048} --batch ${BATCH:-4} --lora 16 \
      --impl ${TORCH_IMPLS:-hf liger} --steps ${STEPS:-10} --out $R/torch-$m.jsonl > $R/torch-$m.log 2>&1
  echo "rc $?" >> $R/torch-$m.log
  python3 -c "
import json
for l in open('$R/torch-$m.jsonl'):
    r = json.loads(l); print(r['implementation'], r['model'], 'ms', r.get('ms_per_step'), 'in use', r.get('in_use_mib'), r.get('error'))" 2>&1 | tail -3
done
tar -C $OUT -cJf $OUT/r.tar.xz r && rm -rf $R
