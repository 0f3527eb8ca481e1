#!/usr/bin/env bash
# Activation checkpointing against HF + Liger-Kernel with HF's gradient checkpointing, one GPU,
# Qwen3-0.6B, bf16, batch 1: Bastile at 8192 tokens with and without checkpointing and at
# 131072 with it (BIN, a release bench build); PyTorch the same (HF and HF + Liger-Kernel,
# SDPA, AdamW(fused=True), clip 1.0). Results under $OUT/r.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt
w=/tmp/w; mkdir -p $w
[ -x $w/bench ] || { xz -dc ${BIN:-.device/x2/bench-m.xz} > $w/bench && chmod +x $w/bench; }
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
d=/tmp/caches; mkdir -p $d
bench() { # tag args...
  local tag=$1; shift
  ( cd $d && BASTILE_KERNEL_CACHE=$d/kernels CUDA_CACHE_PATH=$d/cuda XDG_CACHE_HOME=$d/xdg timeout ${BENCH_TIMEOUT:-400} \
    $w/bench --runtime cuda --model qwen3-0.6b --batch 1 --impl bastile --no-cold-start "$@" --out $R/$tag.json ) > $R/$tag.log 2>&1
  echo "rc $?" >> $R/$tag.log; echo "== $tag"; grep -E "ms/step|error|panick|rc " $R/$tag.log | head -4
}
torch() { # tag args...
  local tag=$1; shift
  ( cd benches/python && PYTHONPATH=/tmp/site timeout ${TORCH_TIMEOUT:-400} python3 train_torch.py --model qwen3-0.6b --batch 1 "$@" \
    --out $R/$tag.jsonl ) > $R/$tag.log 2>&1; echo "rc $?" >> $R/$tag.log; echo "== $tag"; cat $R/$tag.jsonl 2>/dev/null | cut -c1-400
}
for part in ${PARTS:-plain ckpt long torch-plain torch-ckpt torch-long}; do
  case $part in
    plain) bench bastile-8192 --seq 8192 --steps 10 ;;
    ckpt) bench bastile-8192-checkpointing --seq 8192 --steps 10 --checkpointing ;;
    long) bench bastile-131072-checkpointing --seq 131072 --steps ${LONG_STEPS:-3} --checkpointing ;;
    torch-plain) torch torch-8192 --seq 8192 --impl hf liger --steps 10 ;;
    torch-ckpt) torch torch-8192-checkpointing --seq 8192 --impl hf liger --steps 10 --checkpointing ;;
    torch-long) torch torch-131072-checkpointing --seq 131072 --impl hf liger --steps ${LONG_STEPS:-3} --checkpointing ;;
  esac
done
tar -C $OUT -cJf $OUT/r-${TAG:-ckpt}.tar.xz r && rm -rf $R
