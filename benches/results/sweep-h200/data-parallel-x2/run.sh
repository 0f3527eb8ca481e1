#!/usr/bin/env bash
# Data-parallel: one model, 1 and 2 GPUs, over each CUDA backend in turn (RTS).
set -u
R=$OUT/r; mkdir -p $R
w=/tmp/w; mkdir -p $w
[ -x $w/bench-a ] || { xz -dc .device/b/bench-a.xz > $w/bench-a && chmod +x $w/bench-a; }
nccl=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))")
export LD_LIBRARY_PATH=$nccl:${LD_LIBRARY_PATH:-}
echo "nccl: $nccl ($(ls $nccl))" > $R/env.txt; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> $R/env.txt
d=/tmp/caches; mkdir -p $d
for rt in ${RTS:-cuda-fusion cuda-direct}; do
  ( cd $d && BASTILE_KERNEL_CACHE=$d/kernels CUDA_CACHE_PATH=$d/cuda XDG_CACHE_HOME=$d/xdg timeout ${BENCH_TIMEOUT:-200} \
    $w/bench-a --runtime $rt --model ${MODEL:-llama-3.2-1b} --seq ${SEQ:-4096} --batch 1 --devices 1,2 --impl bastile \
    --steps ${STEPS:-10} --no-cold-start --child-timeout 150 --out $R/dp-$rt.json ) > $R/dp-$rt.log 2>&1
  echo "rc $?" >> $R/dp-$rt.log
  echo "== $rt"; grep -E "ms/step|failed|error|panick" $R/dp-$rt.log | head -6; grep -A6 -i "scaling" $R/dp-$rt.md 2>/dev/null | head -8
done
tar -C $OUT -cJf $OUT/r-${TAG:-dp}.tar.xz r && rm -rf $R
