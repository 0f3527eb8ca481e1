#!/usr/bin/env bash
# Issue 32: a new length on the caches a first length left, with the
# kernel workers (bench-pre): a first process at 4096 tokens on empty
# caches, a second at 4096 and a third at 6144 on what it left.
set -u
root="$PWD"
w=/tmp/w; mkdir -p $w; cd $w
[ -x bench-pre ] || { xz -dc "$root/.device/b/bench-pre.xz" > bench-pre && chmod +x bench-pre; }
R=$OUT/r; mkdir -p $R
stamp() { python3 -u -c '
import sys, time
t0 = time.time()
for line in sys.stdin:
    print(f"{time.time() - t0:8.3f}  {line}", end="", flush=True)'; }
child() { ( cd $1 && BASTILE_KERNEL_CACHE=$1/kernels CUDA_CACHE_PATH=$1/cuda XDG_CACHE_HOME=$1/xdg timeout 100 $w/bench-pre --runtime cuda \
      --model $2 --batch 1 --seq $3 --impl bastile --steps 1 --child --first-step-only 2>&1 ) | stamp > $R/$4.log
  echo "$4: $(grep ended $R/$4.log | cut -c1-80) $(grep 'workers' $R/$4.log | cut -c10-120 | tr '\n' ' ')"; }
for m in qwen3-0.6b gpt-oss-20b-4l; do
  d=/tmp/nl-$m; rm -rf $d; mkdir -p $d
  child $d $m 4096 nl-$m-4096-cold
  child $d $m 4096 nl-$m-4096-warm
  child $d $m 6144 nl-$m-6144-new
done
tar -C $OUT -cJf $OUT/r.tar.xz r && rm -rf $R
