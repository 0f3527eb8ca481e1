#!/usr/bin/env bash
# The run behind this folder, on one H100: the release bench with the
# fixed-strategy reductions (bench-red) against the build before them
# (bench-at), carried as stripped, xz-compressed binaries in .device/b/:
# cold and warm starts, a stamped cold log, steady steps alternating.
set -u
root="$PWD"
mkdir -p /work && [ -e /work/main ] || ln -sfn "$root" /work/main
w=/tmp/w; mkdir -p $w; cd $w
for v in at red; do
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
if [ -f "$root/.device/b/burn-main.xz" ]; then
  xz -dc "$root/.device/b/burn-main.xz" > burn-main && chmod +x burn-main
  mkdir -p tests && printf '[compilation]\ncheck_mode = "validate"\n' > tests/cubecl.toml
  ( cd tests && BASTILE_TUNE=full BASTILE_TEST_RUNTIMES=cuda timeout 240 ../burn-main --test-threads 1 reduce:: model_step:: ) > $R/tests.log 2>&1
  tail -4 $R/tests.log
fi
# 1. Cold and warm starts, both builds.
for v in red at; do
timeout 200 ./bench-$v --runtime cuda --model gpt-oss-20b-4l,qwen3-0.6b,llama-3.2-1b --seq 4096 --batch 1 --impl bastile --steps 10 \
  --out $R/starts-$v.json 2>&1 | stamp > $R/starts-$v.log
grep -E "^ *[0-9.]+ +\| (gpt|qwen|llama)" $R/starts-$v.log | head -3 | cut -c1-40,90-300
done
# 2. A stamped cold run of GPT-OSS.
d=/tmp/cold-red; rm -rf $d; mkdir -p $d
printf '[compilation.logger]\nlevel = "basic"\nstderr = true\n[autotune.logger]\nlevel = "minimal"\nstderr = true\n' > $d/cubecl.toml
( cd $d && BASTILE_KERNEL_CACHE=$d/kernels CUDA_CACHE_PATH=$d/cuda XDG_CACHE_HOME=$d/xdg timeout 100 $w/bench-red --runtime cuda \
    --model gpt-oss-20b-4l --batch 1 --seq 4096 --impl bastile --steps 1 --child --first-step-only 2>&1 ) | stamp > $R/cold-red-gpt-oss.log
grep "ended" $R/cold-red-gpt-oss.log
# 3. Steady steps, alternating.
steady() { local v=$1 m=$2 s=$3 tag=$4
  timeout 200 ./bench-$v --runtime cuda --model $m --seq $s --batch 1 \
    --impl bastile --steps 12 --no-cold-start --out $R/steady-$tag.json > $R/steady-$tag.log 2>&1
  python3 -c "
import json
for r in json.load(open('$R/steady-$tag.json'))['train']:
    print('$tag', r['model'], r['seq'], r['ms_per_step'], r.get('start_s'))"
}
for r in 1 2; do
  steady at gpt-oss-20b-4l 4096 g-at-$r
  steady red gpt-oss-20b-4l 4096 g-red-$r
  steady at qwen3-0.6b 16384 q-at-$r
  steady red qwen3-0.6b 16384 q-red-$r
done
tar -C $OUT -cJf $OUT/r.tar.xz r && rm -rf $R
