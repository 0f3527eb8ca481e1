#!/usr/bin/env bash
# Issue 32: whole-tensor and int sums with a fixed strategy (bench-sum)
# against HEAD's build (bench-red): cold and warm starts, a new length on
# warm caches, a stamped cold log, steady steps alternating in one lease;
# the reduce tests and a model step on CUDA.
set -u
root="$PWD"
mkdir -p /work && [ -e /work/main ] || ln -sfn "$root" /work/main
w=/tmp/w; mkdir -p $w; cd $w
for v in red sum; do
  [ -x bench-$v ] || { xz -dc "$root/.device/b/bench-$v.xz" > bench-$v && chmod +x bench-$v; }
done
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt
stamp() { python3 -u -c '
import sys, time
t0 = time.time()
for line in sys.stdin:
    print(f"{time.time() - t0:8.3f}  {line}", end="", flush=True)'; }
# 0. The reduce tests and a model step on CUDA (bounds checks on).
on() { [[ " ${SECTIONS:-0 1 2 3 4} " == *" $1 "* ]]; }
if on 0 && [ -f "$root/.device/b/burn-main.xz" ]; then
  xz -dc "$root/.device/b/burn-main.xz" > burn-main && chmod +x burn-main
  mkdir -p tests && printf '[compilation]\ncheck_mode = "validate"\n' > tests/cubecl.toml
  ( cd tests && BASTILE_TUNE=full BASTILE_TEST_RUNTIMES=cuda timeout 240 ../burn-main --test-threads 1 reduce:: model_step:: cross_entropy::cross_entropy_on_logits ) > $R/tests.log 2>&1
  tail -4 $R/tests.log
fi
# 1. Cold and warm starts, both builds.
on 1 && for v in ${BUILDS:-sum red}; do
timeout 200 ./bench-$v --runtime cuda --model gpt-oss-20b-4l,qwen3-0.6b,llama-3.2-1b --seq 4096 --batch 1 --impl bastile --steps 10 \
  --out $R/starts-$v.json 2>&1 | stamp > $R/starts-$v.log
grep -E "^ *[0-9.]+ +\| (gpt|qwen|llama)" $R/starts-$v.log | head -3 | cut -c1-40,90-300
done
# 2. A new length on the caches a first length left (bench-sum).
child() { ( cd $1 && BASTILE_KERNEL_CACHE=$1/kernels CUDA_CACHE_PATH=$1/cuda XDG_CACHE_HOME=$1/xdg timeout 100 $w/bench-sum --runtime cuda \
      --model $2 --batch 1 --seq $3 --impl bastile --steps 1 --child --first-step-only 2>&1 ) | stamp > $R/$4.log
  echo "$4: $(grep ended $R/$4.log)"; }
on 2 && for m in qwen3-0.6b gpt-oss-20b-4l; do
  d=/tmp/nl-$m; rm -rf $d; mkdir -p $d
  child $d $m 4096 nl-$m-4096-cold
  child $d $m 4096 nl-$m-4096-warm
  child $d $m 6144 nl-$m-6144-new
done
# 3. A stamped cold run of GPT-OSS (bench-sum).
if on 3; then
d=/tmp/cold-sum; rm -rf $d; mkdir -p $d
printf '[compilation.logger]\nlevel = "basic"\nstderr = true\n[autotune.logger]\nlevel = "minimal"\nstderr = true\n' > $d/cubecl.toml
( cd $d && BASTILE_KERNEL_CACHE=$d/kernels CUDA_CACHE_PATH=$d/cuda XDG_CACHE_HOME=$d/xdg timeout 100 $w/bench-sum --runtime cuda \
    --model gpt-oss-20b-4l --batch 1 --seq 4096 --impl bastile --steps 1 --child --first-step-only 2>&1 ) | stamp > $R/cold-sum-gpt-oss.log
grep "ended" $R/cold-sum-gpt-oss.log
fi
# 4. Steady steps, alternating.
steady() { local v=$1 m=$2 s=$3 tag=$4
  timeout 200 ./bench-$v --runtime cuda --model $m --seq $s --batch 1 \
    --impl bastile --steps 12 --no-cold-start --out $R/steady-$tag.json > $R/steady-$tag.log 2>&1
  python3 -c "
import json
for r in json.load(open('$R/steady-$tag.json'))['train']:
    print('$tag', r['model'], r['seq'], r['ms_per_step'], r.get('start_s'))"
}
on 4 && for r in ${ROUNDS:-1 2}; do
  steady red gpt-oss-20b-4l 4096 g-red-$r
  steady sum gpt-oss-20b-4l 4096 g-sum-$r
  steady red qwen3-0.6b 2048 q-red-$r
  steady sum qwen3-0.6b 2048 q-sum-$r
done
tar -C $OUT -cJf $OUT/r.tar.xz r && rm -rf $R
