#!/usr/bin/env bash
# One lease: RUNS picks what runs (oss-trace, oss, oss-dense, moe-op, ties, torch-oss, qwen ...).
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt
w=/tmp/w; mkdir -p $w
for b in ${BUILDS-bench-a}; do [ -x $w/$b ] || { xz -dc .device/b/$b.xz > $w/$b && chmod +x $w/$b; }; done
inc=$(dirname $(find /usr/local -name cupti_activity.h | head -1))
lib=$(dirname $(find /usr/local -name 'libcupti.so*' | head -1))
[ -f /tmp/libkt.so ] || gcc -O2 -shared -fPIC -DKTYPE=CUpti_ActivityKernel10 -I$inc benches/cupti/kernel_trace.c -L$lib -lcupti -Wl,-rpath,$lib -o /tmp/libkt.so
[ -d /tmp/site ] || { ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; }
bench() { # bin tag trace(0/1/api) args...
  local b=$1 tag=$2 trace=$3; shift 3
  local d=/tmp/caches-$b; mkdir -p $d
  local inj=""; [ $trace != 0 ] && inj=/tmp/libkt.so
  local api=""; [ $trace = api ] && api=1
  ( cd $d && env KERNEL_TRACE_OUT=$R/k-$tag.txt CUDA_INJECTION64_PATH=$inj ${api:+KERNEL_TRACE_API=1} \
    BASTILE_KERNEL_CACHE=$d/kernels CUDA_CACHE_PATH=$d/cuda XDG_CACHE_HOME=$d/xdg timeout ${BENCH_TIMEOUT:-240} $w/$b --runtime cuda \
    "$@" --out $R/$tag.json > $R/$tag.log 2>&1 ); echo "rc $?" >> $R/$tag.log
  echo "== $tag"; grep -E "ms/step|error|panick|moe " $R/$tag.log | head -6
  if [ -f $R/k-$tag.txt ]; then
    python3 benches/results/moe-routed-h100/device-router/step_kernels.py $R/k-$tag.txt > $R/step-kernels-$tag.txt 2>&1; head -4 $R/step-kernels-$tag.txt
    [ -n "$api" ] && { python3 benches/cupti/host_gaps.py $R/k-$tag.txt 0.3 8 40 > $R/host-gaps-$tag.txt 2>&1; head -40 $R/host-gaps-$tag.txt; }
    xz -T4 $R/k-$tag.txt
  fi
}
B=${NEW:-bench-a}
for run in ${RUNS:-oss-trace}; do
  seq=4096; case $run in *-s[0-9]*) seq=${run##*-s};; esac
  case $run in
    oss4-s*) bench $B $run 0 --model gpt-oss-20b-4l --batch 1 --seq $seq --impl bastile --steps 12 --no-cold-start ;;
    oss8-s*) bench $B $run 0 --model gpt-oss-20b-8l --batch 1 --seq $seq --impl bastile --steps 12 --no-cold-start ;;
    torch4-s*|torch8-s*) m=gpt-oss-20b-4l; [ ${run:5:1} = 8 ] && m=gpt-oss-20b-8l
      PYTHONPATH=/tmp/site timeout ${TORCH_TIMEOUT:-300} python3 benches/python/train_torch.py --model $m --seq $seq --batch 1 \
        --impl ${TORCH_IMPLS:-hf liger} --steps ${TSTEPS:-10} --out $R/$run.jsonl > $R/$run.log 2>&1; echo "rc $?" >> $R/$run.log
      python3 -c "
import json
for l in open('$R/$run.jsonl'):
    r = json.loads(l); print('$run', r['implementation'], 'ms', round(r.get('ms_per_step') or 0, 1), 'in use', round(r.get('in_use_mib') or 0), r.get('error'))" 2>&1 | tail -3 ;;
    oss-trace) bench $B $run api --model gpt-oss-20b-4l --batch 1 --seq 4096 --impl bastile --steps 8 --no-cold-start ;;
    oss-old*) bench ${OLD:-bench-a} $run 0 --model gpt-oss-20b-4l --batch 1 --seq 4096 --impl bastile --steps 12 --no-cold-start ;;
    oss|oss-2|oss-3) bench $B $run 0 --model gpt-oss-20b-4l --batch 1 --seq 4096 --impl bastile --steps 12 --no-cold-start ;;
    oss-ktrace) bench $B $run 1 --model gpt-oss-20b-4l --batch 1 --seq 4096 --impl bastile --steps 12 --no-cold-start ;;
    oss-dense) bench $B $run 0 --model gpt-oss-20b-4l --batch 1 --seq 4096 --experts dense --impl bastile --steps 6 --no-cold-start ;;
    oss8) bench $B $run 0 --model gpt-oss-20b-8l --batch 1 --seq 4096 --impl bastile --steps 12 --no-cold-start ;;
    oss-lora) bench $B $run 0 --model gpt-oss-20b-4l --batch 1 --seq 4096 --lora 16 --impl bastile --steps 20 --no-cold-start ;;
    torch-lora) PYTHONPATH=/tmp/site timeout ${TORCH_TIMEOUT:-300} python3 benches/python/train_torch.py --model gpt-oss-20b-4l --seq 4096 --batch 1 --lora 16 \
        --impl hf liger --steps ${TSTEPS:-10} --out $R/$run.jsonl > $R/$run.log 2>&1; echo "rc $?" >> $R/$run.log
      python3 -c "
import json
for l in open('$R/$run.jsonl'):
    r = json.loads(l); print('$run', r['implementation'], 'ms', round(r.get('ms_per_step') or 0, 1), 'in use', round(r.get('in_use_mib') or 0), r.get('error'))" 2>&1 | tail -3 ;;
    moe-op|moe-op-2) bench $B $run 0 --op moe ;;
    moe-op-old*) bench ${OLD:-bench-a} $run 0 --op moe ;;
    moe-trace) bench $B $run api --op moe --samples 3; python3 benches/cupti/gpu_busy.py <(xz -dc $R/k-$run.txt.xz | grep "^K") 60 > $R/busy-$run.txt 2>&1; head -45 $R/busy-$run.txt ;;
    qwen-old*) bench ${OLD:-bench-a} $run 0 --model qwen3-0.6b --batch 1 --seq 2048 --impl bastile --steps 12 --no-cold-start ;;
    llama-old*) bench ${OLD:-bench-a} $run 0 --model llama-3.2-1b --batch 1 --seq 4096 --impl bastile --steps 12 --no-cold-start ;;
    llama|llama-2) bench $B $run 0 --model llama-3.2-1b --batch 1 --seq 4096 --impl bastile --steps 12 --no-cold-start ;;
    qwen|qwen-2) bench $B $run 0 --model qwen3-0.6b --batch 1 --seq 2048 --impl bastile --steps 12 --no-cold-start ;;
    ties) python3 benches/python/topk_ties.py --out $R/topk-ties.json > $R/topk-ties.log 2>&1; tail -20 $R/topk-ties.log ;;
    torch-oss*) m=${run#torch-}; m=${m/oss/gpt-oss-20b-4l}; m=${m/gpt-oss-20b-4l8/gpt-oss-20b-8l}
      PYTHONPATH=/tmp/site timeout ${TORCH_TIMEOUT:-300} python3 benches/python/train_torch.py --model $m --seq ${SEQ:-4096} --batch 1 \
        --impl ${TORCH_IMPLS:-hf liger} --steps ${TSTEPS:-10} --out $R/$run.jsonl > $R/$run.log 2>&1; echo "rc $?" >> $R/$run.log
      python3 -c "
import json
for l in open('$R/$run.jsonl'):
    r = json.loads(l); print(r['implementation'], 'ms', round(r.get('ms_per_step') or 0, 1), 'in use', round(r.get('in_use_mib') or 0), r.get('error'))" 2>&1 | tail -3 ;;
  esac
done
tar -C $OUT -cJf $OUT/r-${TAG:-a}.tar.xz r && rm -rf $R
