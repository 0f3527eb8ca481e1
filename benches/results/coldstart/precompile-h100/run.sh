#!/usr/bin/env bash
# Issue 32: the step's kernels compiled in worker processes beside the
# training process (bench-pre), against the same build with the workers
# off (BASTILE_PRECOMPILE=0): cold and warm starts alternating in one lease,
# a stamped cold run of GPT-OSS with the workers.
set -u
root="$PWD"
w=/tmp/w; mkdir -p $w; cd $w
[ -x bench-pre ] || { xz -dc "$root/.device/b/bench-pre.xz" > bench-pre && chmod +x bench-pre; }
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt
nproc > $R/nproc.txt
stamp() { python3 -u -c '
import sys, time
t0 = time.time()
for line in sys.stdin:
    print(f"{time.time() - t0:8.3f}  {line}", end="", flush=True)'; }
on() { [[ " ${SECTIONS:-1 2} " == *" $1 "* ]]; }
# 1. A stamped cold run of GPT-OSS with the workers (and one without).
if on 1; then
for sm in ${STAMP_MODELS:-gpt-oss-20b-4l}; do
for mode in on off; do
d=/tmp/cold-$mode; rm -rf $d; mkdir -p $d
printf '[compilation.logger]\nlevel = "basic"\nstderr = true\n' > $d/cubecl.toml
pc=1; [ $mode = off ] && pc=0
t0=$(date +%s.%N)
( cd $d && BASTILE_PRECOMPILE_LOG=$R/workers-$sm-$mode BASTILE_PRECOMPILE=$pc BASTILE_KERNEL_CACHE=$d/kernels CUDA_CACHE_PATH=$d/cuda XDG_CACHE_HOME=$d/xdg timeout 100 $w/bench-pre --runtime cuda \
    --model $sm --batch 1 --seq 4096 --impl bastile --steps 1 --child --first-step-only 2>&1 ) | stamp > $R/cold-$sm-$mode.log
for f in $R/workers-$sm-$mode/*.log; do [ -f $f ] && echo "$(basename $f): last write $(python3 -c "import os;print(round(os.path.getmtime('$f')-$t0,1))") s, $(grep -c 'Compiling kernel' $f) compiled; $(tail -1 $f | cut -c1-100)"; done
echo "$sm $mode: $(grep ended $R/cold-$sm-$mode.log) $(grep -c 'Compiling kernel' $R/cold-$sm-$mode.log) compiled; $(grep 'kernel workers' $R/cold-$sm-$mode.log)"
du -sh $d/kernels $d/cuda 2>/dev/null | tr '\n' ' '; echo
done
done
fi
# 2. Cold and warm starts, workers on and off, alternating.
starts() { local models=$1 tag=$2 pc=$3
  BASTILE_PRECOMPILE=$pc timeout 280 ./bench-pre --runtime cuda --model $models --seq 4096 --batch 1 --impl bastile --steps 6 \
    --out $R/starts-$tag.json > $R/starts-$tag.log 2>&1
  python3 -c "
import json
for r in json.load(open('$R/starts-$tag.json'))['train']:
    print('$tag', r['model'], r['seq'], 'cold', r.get('cold_start_s'), 'warm', r.get('start_s'), 'ms', r.get('ms_per_step'), r.get('error'))"
}
if on 2; then
for r in ${ROUNDS:-1 2}; do
  if [ $((r % 2)) = 1 ]; then
    starts ${MODELS:-gpt-oss-20b-4l} on-$r 1
    starts ${MODELS:-gpt-oss-20b-4l} off-$r 0
  else
    starts ${MODELS:-gpt-oss-20b-4l} off-$r 0
    starts ${MODELS:-gpt-oss-20b-4l} on-$r 1
  fi
done
fi
tar -C $OUT -cJf $OUT/r.tar.xz r && rm -rf $R
