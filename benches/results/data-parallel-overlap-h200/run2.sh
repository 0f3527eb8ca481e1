#!/usr/bin/env bash
# x2: hand-over log of bench-log (Llama, 2 GPUs), then sweeps of bench-log and bench-seg.
set -u
mkdir -p .device/b $OUT/r
for f in .device/dp/*.xz; do ln -sf $(pwd)/$f .device/b/$(basename $f); done
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nccl=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))")
export LD_LIBRARY_PATH=$nccl:${LD_LIBRARY_PATH:-}
w=/tmp/w; mkdir -p $w; xz -dc .device/b/bench-log.xz > $w/bench-log; chmod +x $w/bench-log
d=/tmp/caches-bench-log; mkdir -p $d
( cd $d && BASTILE_SUMS_LOG=1 BASTILE_KERNEL_CACHE=$d/kernels CUDA_CACHE_PATH=$d/cuda XDG_CACHE_HOME=$d/xdg timeout 200 $w/bench-log --runtime cuda --model ${LOGMODEL:-llama-3.2-1b} --seq 4096 --batch 1 --impl bastile --devices 2 --steps 10 --no-cold-start --out $OUT/r/log.json > $OUT/r/log.txt 2>&1 )
grep -c SUMS $OUT/r/log.txt; grep "ms/step" $OUT/r/log.txt | head
NEW=bench-log OLD=bench-seg DEVS=1,2 TRACES= TAG=${TAG:-x2b} BENCH_TIMEOUT=280 bash benches/results/data-parallel-h100x2/run.sh
