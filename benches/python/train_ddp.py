"""Data-parallel training steps through PyTorch DDP, as a user of HF
transformers + Liger-Kernel runs them on several GPUs: one process per
GPU (torchrun), `DistributedDataParallel` (NCCL, gradients bucketed and
all-reduced during the backward pass), HF's default attention (SDPA),
`AdamW(fused=True)` and `clip_grad_norm_(1.0)`; the same configuration as
`bastile-bench --model <preset> --devices N`: random weights in bf16, each
GPU its own micro-batch of random tokens (labels = ids) per step.

Rank 0 prints one JSON object: the median step time over the timed steps,
tokens/s over all GPUs, and its GPU's peak bytes in use
(`max_memory_allocated`) and reservation.

Usage: torchrun --nproc_per_node 4 train_ddp.py --model qwen3-1.7b --seq 4096 \
           [--batch 1] [--impl liger|hf] [--steps 8]
"""

import argparse
import json
import os
import statistics
import sys
import time

from train_torch import LIGER, PRESETS, closing_fields


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-1.7b", choices=sorted(PRESETS))
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--impl", choices=["hf", "liger"], default="liger")
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoConfig, AutoModelForCausalLM

    rank = int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    fields = dict(PRESETS[args.model])
    model_type = fields.pop("model_type")
    if args.impl == "liger":
        import liger_kernel.transformers as liger

        getattr(liger, LIGER[model_type])()
    config = AutoConfig.for_model(model_type, **fields)
    # Every rank starts from the same weights (DDP also broadcasts rank
    # 0's at wrapping).
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16).cuda()
    model.train()
    ddp = DistributedDataParallel(model, device_ids=[rank])
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-5, fused=True)
    torch.manual_seed(1 + rank)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device="cuda")
    times = []
    first_step_s = None
    for i in range(2 + args.steps):
        torch.cuda.synchronize()
        dist.barrier()
        t = time.perf_counter()
        loss = ddp(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = loss.item()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t
        if i == 0:
            first_step_s = elapsed
        if i == 1:
            torch.cuda.reset_peak_memory_stats()
        if i >= 2:
            times.append(elapsed)
        if rank == 0:
            print(f"step {i}: loss {loss_value:.4f}, {elapsed * 1e3:.1f} ms", file=sys.stderr)
    if rank == 0:
        ms = statistics.median(times) * 1e3
        name = {"hf": "HF transformers", "liger": "HF + Liger-Kernel"}[args.impl]
        print(json.dumps({
            "model": args.model,
            "batch": args.batch,
            "seq": args.seq,
            "dtype": "bf16",
            "implementation": f"{name}, DDP" + (f", {world} GPUs" if world > 1 else ""),
            "devices": world,
            "attention": model.config._attn_implementation,
            "ms_per_step": ms,
            "tokens_per_s": world * args.batch * args.seq / (ms / 1e3),
            "ms_range": [min(times) * 1e3, max(times) * 1e3],
            **closing_fields(first_step_s),
        }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
