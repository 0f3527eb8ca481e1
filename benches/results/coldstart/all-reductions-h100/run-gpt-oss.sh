#!/usr/bin/env bash
# Issue 32: GPT-OSS-20B (4 layers) cold and warm starts, the fixed
# strategies for every reduction (bench-sum) and HEAD's build (bench-red)
# alternating in one lease.
set -u
root="$PWD"
w=/tmp/w; mkdir -p $w; cd $w
for v in red sum; do
  [ -x bench-$v ] || { xz -dc "$root/.device/b/bench-$v.xz" > bench-$v && chmod +x bench-$v; }
done
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt
lscpu | grep -E "Model name|^CPU\(s\)" >> $R/gpu.txt
for r in 1 2; do for v in sum red; do
  timeout 120 ./bench-$v --runtime cuda --model gpt-oss-20b-4l --seq 4096 --batch 1 --impl bastile --steps 6 \
    --out $R/starts-$v-$r.json > $R/starts-$v-$r.log 2>&1
  python3 -c "
import json
for x in json.load(open('$R/starts-$v-$r.json'))['train']:
    print('$v-$r', x['model'], x['cold_start_s'], x['start_s'], x['ms_per_step'])"
done; done
tar -C $OUT -cJf $OUT/r.tar.xz r && rm -rf $R
