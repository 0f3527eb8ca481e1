#!/usr/bin/env bash
# Issue 32: `bastile finetune` on a fresh machine with the kernel workers
# (cold caches), then again on the caches it left.
set -u
root="$PWD"
w=/tmp/w; mkdir -p $w; cd $w
xz -dc "$root/.device/b/cli.xz" > bastile && chmod +x bastile
R=$OUT/r; mkdir -p $R
d=/tmp/ft; rm -rf $d; mkdir -p $d
run() { ( cd $d && BASTILE_PRECOMPILE_LOG=$R/workers-$1 BASTILE_KERNEL_CACHE=$d/kernels CUDA_CACHE_PATH=$d/cuda XDG_CACHE_HOME=$d/xdg \
  /usr/bin/time -f "%e s wall" timeout 200 $w/bastile finetune --model ${MODEL:-bastile-tiny} --steps 10 --output $d/out-$1 2>&1 ); }
run cold > $R/cold.log; echo "exit $?"
run warm > $R/warm.log; echo "exit $?"
for f in cold warm; do echo "== $f"; grep -v "^\s*$" $R/$f.log | tail -6 | cut -c1-200; done
ls $R/workers-cold 2>/dev/null; for f in $R/workers-cold/*.log; do echo "$(basename $f): $(grep -c Compiling $f) compiled, $(tail -1 $f | cut -c1-120)"; done
tar -C $OUT -cJf $OUT/r.tar.xz r && rm -rf $R
