#!/usr/bin/env bash
# Data-parallel sweep on a multi-GPU machine: NEW and OLD bench builds, MODELS at 4096 per GPU,
# DEVS GPU counts; then a kernel trace (with device and stream) of NEW on TRACE_DEVS GPUs.
set -u
R=$OUT/r; mkdir -p $R
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nccl=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
export LD_LIBRARY_PATH=$nccl:${LD_LIBRARY_PATH:-}
echo "nccl: $nccl ($(ls $nccl 2>/dev/null | tr '\n' ' '))" | tee $R/env.txt
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> $R/env.txt
nvidia-smi topo -m >> $R/env.txt 2>&1
w=/tmp/w; mkdir -p $w
for b in ${NEW:-bench-dp} ${OLD:-bench-rt}; do [ -x $w/$b ] || { xz -dc .device/b/$b.xz > $w/$b && chmod +x $w/$b; }; done
inc=$(dirname $(find /usr/local -name cupti_activity.h | head -1))
lib=$(dirname $(find /usr/local -name 'libcupti.so*' | head -1))
[ -f /tmp/libkt.so ] || gcc -O2 -shared -fPIC -DKTYPE=CUpti_ActivityKernel10 -I$inc benches/cupti/kernel_trace.c -L$lib -lcupti -Wl,-rpath,$lib -o /tmp/libkt.so
bench() { # bin tag trace args...
  local b=$1 tag=$2 trace=$3; shift 3
  local d=/tmp/caches-$b; mkdir -p $d
  ( cd $d && KERNEL_TRACE_PLACE=1 KERNEL_TRACE_OUT=$R/k-$tag.txt CUDA_INJECTION64_PATH=$([ $trace = 1 ] && echo /tmp/libkt.so) \
    BASTILE_KERNEL_CACHE=$d/kernels CUDA_CACHE_PATH=$d/cuda XDG_CACHE_HOME=$d/xdg timeout ${BENCH_TIMEOUT:-400} $w/$b --runtime cuda \
    "$@" --out $R/$tag.json > $R/$tag.log 2>&1 ); echo "rc $?" >> $R/$tag.log
  echo "== $tag"; grep -E "ms/step|efficiency|error|panick|rc " $R/$tag.log | head -12
  if [ -f $R/k-$tag.txt ]; then python3 benches/cupti/streams_overlap.py $R/k-$tag.txt ${WIN:-400} > $R/overlap-$tag.txt 2>&1; cat $R/overlap-$tag.txt; xz -T4 $R/k-$tag.txt; fi
}
for b in ${BUILDS-${NEW:-bench-dp} ${OLD:-bench-rt}}; do
  bench $b sweep-$b 0 --model ${MODELS:-qwen3-1.7b,llama-3.2-1b} --seq 4096 --batch 1 --impl bastile --devices ${DEVS:-1,2,4} --steps ${STEPS:-10} --no-cold-start
  grep -A12 "Data-parallel scaling" $R/sweep-$b.md 2>/dev/null | grep "|" | tail -6
done
# TRACES: build:GPUs[:NAME=VALUE] runs with a kernel trace (an optional environment variable set).
for t in ${TRACES-${NEW:-bench-dp}:2}; do
  IFS=: read tb tn tenv <<< "$t"
  ( [ -n "$tenv" ] && export "$tenv"; bench $tb trace-$tb-$tn${tenv:+-${tenv%%=*}} 1 --model ${TRACE_MODEL:-qwen3-1.7b} --seq 4096 --batch 1 --impl bastile --devices $tn --steps 6 --no-cold-start )
done
if [ -n "${DDP_RUNS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  for run in $DDP_RUNS; do
    IFS=: read model n <<< "$run"
    ( cd benches/python && PYTHONPATH=/tmp/site timeout ${DDP_TIMEOUT:-240} torchrun --standalone --nproc_per_node $n train_ddp.py \
        --model $model --seq 4096 --impl liger --steps ${DDP_STEPS:-8} >> $R/ddp-liger.jsonl 2>> $R/ddp-liger.log ); echo "rc $? $run" >> $R/ddp-liger.log
    tail -1 $R/ddp-liger.jsonl
  done
fi
tar -C $OUT -cJf $OUT/r-${TAG:-a}.tar.xz r && rm -rf $R
