#!/usr/bin/env bash
# Bastile (this code's release build, bench-a) and the PyTorch rows (--compare-pytorch: HF transformers with SDPA,
# HF + Liger-Kernel 0.8.5, HF under torch.compile; AdamW(fused=True), clip_grad_norm_(1.0)) in one lease.
set -u; R=$OUT/r; mkdir -p $R; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt
w=/tmp/w; mkdir -p $w; xz -dc .device/b/bench-a.xz > $w/bench-a && chmod +x $w/bench-a
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site BASTILE_PYTHON_SCRIPTS=$(pwd)/benches/python; d=/tmp/caches; mkdir -p $d; cd $d
for mc in qwen3-0.6b:2048 llama-3.2-1b:4096; do m=${mc%%:*}; s=${mc##*:}
  BASTILE_KERNEL_CACHE=$d/kernels CUDA_CACHE_PATH=$d/cuda XDG_CACHE_HOME=$d/xdg timeout 270 $w/bench-a --runtime cuda --model $m --seq $s \
    --batch 1 --impl bastile --steps 20 --compare-pytorch --out $R/$m-$s.json > $R/$m-$s.log 2>&1; echo "rc $?" >> $R/$m-$s.log
done
tar -C $OUT -cJf $OUT/r-final.tar.xz r
