#!/usr/bin/env bash
# One lease: new build (NEW) against the build before (OLD): GPT-OSS routed
# (kernel trace of the new), dense, Qwen3-0.6B, the AdamW op; PyTorch GPT-OSS.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt
w=/tmp/w; mkdir -p $w
for b in ${NEW:-bench-rt} ${OLD:-bench-lr}; do [ -x $w/$b ] || { xz -dc .device/b/$b.xz > $w/$b && chmod +x $w/$b; }; done
inc=$(dirname $(find /usr/local -name cupti_activity.h | head -1))
lib=$(dirname $(find /usr/local -name 'libcupti.so*' | head -1))
[ -f /tmp/libkt.so ] || gcc -O2 -shared -fPIC -DKTYPE=CUpti_ActivityKernel10 -I$inc benches/cupti/kernel_trace.c -L$lib -lcupti -Wl,-rpath,$lib -o /tmp/libkt.so
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
bench() { # bin tag trace? args...
  local b=$1 tag=$2 trace=$3; shift 3
  local d=/tmp/caches-$b; mkdir -p $d
  ( cd $d && KERNEL_TRACE_OUT=$R/k-$tag.txt CUDA_INJECTION64_PATH=$([ $trace = 1 ] && echo /tmp/libkt.so) \
    BASTILE_KERNEL_CACHE=$d/kernels CUDA_CACHE_PATH=$d/cuda XDG_CACHE_HOME=$d/xdg timeout ${BENCH_TIMEOUT:-240} $w/$b --runtime cuda \
    "$@" --out $R/$tag.json > $R/$tag.log 2>&1 ); echo "rc $?" >> $R/$tag.log
  echo "== $tag"; grep -E "ms/step|error|panick" $R/$tag.log | head -3
  if [ -f $R/k-$tag.txt ]; then python3 benches/cupti/gpu_busy.py $R/k-$tag.txt ${WIN:-600} > $R/busy-$tag.txt 2>&1; head -3 $R/busy-$tag.txt; xz -T4 $R/k-$tag.txt; fi
}
for run in ${RUNS:-oss-routed-new oss-routed-old}; do
  case $run in
    oss-routed-new) bench ${NEW:-bench-rt} $run 1 --model gpt-oss-20b-4l --batch 1 --seq 4096 --routed-experts --impl bastile --steps 12 --no-cold-start ;;
    oss-routed-old) bench ${OLD:-bench-lr} $run 0 --model gpt-oss-20b-4l --batch 1 --seq 4096 --routed-experts --impl bastile --steps 12 --no-cold-start ;;
    oss-dense-new) bench ${NEW:-bench-rt} $run 0 --model gpt-oss-20b-4l --batch 1 --seq 4096 --impl bastile --steps 6 --no-cold-start ;;
    qwen-new) bench ${NEW:-bench-rt} $run 1 --model qwen3-0.6b --batch 1 --seq 2048 --impl bastile --steps 12 --no-cold-start ;;
    qwen-old) bench ${OLD:-bench-lr} $run 0 --model qwen3-0.6b --batch 1 --seq 2048 --impl bastile --steps 12 --no-cold-start ;;
    oss-lora-new) bench ${NEW:-bench-rt} $run 0 --model gpt-oss-20b-4l --batch 1 --seq 4096 --routed-experts --lora 16 --impl bastile --steps 20 --no-cold-start ;;
    torch-oss-lora) PYTHONPATH=/tmp/site timeout ${TORCH_TIMEOUT:-300} python3 benches/python/train_torch.py --model gpt-oss-20b-4l --seq 4096 --batch 1 --lora 16 \
        --impl hf liger --steps ${TSTEPS:-10} --out $R/torch-oss-lora.jsonl > $R/torch-oss-lora.log 2>&1; echo "rc $?" >> $R/torch-oss-lora.log
      python3 -c "
import json
for l in open('$R/torch-oss-lora.jsonl'):
    r = json.loads(l); print(r['implementation'], 'ms', round(r.get('ms_per_step') or 0, 1), 'in use', round(r.get('in_use_mib') or 0), r.get('error'))" 2>&1 | tail -3 ;;
    adamw-new) bench ${NEW:-bench-rt} $run 0 --op adamw ;;
    adamw-old) bench ${OLD:-bench-lr} $run 0 --op adamw ;;
    torch-oss) PYTHONPATH=/tmp/site timeout ${TORCH_TIMEOUT:-300} python3 benches/python/train_torch.py --model gpt-oss-20b-4l --seq 4096 --batch 1 \
        --impl ${TORCH_IMPLS:-hf liger} --steps ${TSTEPS:-10} --out $R/torch-oss.jsonl > $R/torch-oss.log 2>&1; echo "rc $?" >> $R/torch-oss.log
      python3 -c "
import json
for l in open('$R/torch-oss.jsonl'):
    r = json.loads(l); print(r['implementation'], 'ms', round(r.get('ms_per_step') or 0, 1), 'in use', round(r.get('in_use_mib') or 0), r.get('error'))" 2>&1 | tail -3 ;;
  esac
done
tar -C $OUT -cJf $OUT/r-${TAG:-a}.tar.xz r && rm -rf $R
