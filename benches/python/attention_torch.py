"""PyTorch scaled_dot_product_attention on the shapes of
`cargo xtask bench --op attention` (b 1, causal, bf16; query heads x
key-value heads x head dim 16x8x128 as Qwen3's, 32x8x64 as Llama 3.2's):
forward and forward+backward time, causal TFLOP/s counted the same way
(half the score matrix; backward = 2.5 forwards) and peak memory.

Prints one JSON object per row on stdout (progress on stderr).

Usage: python3 attention_torch.py [--seq 2048,4096,8192,16384] [--shapes 16x8x128,32x8x64]
       [--calls 10] [--out results.json]
"""

import argparse
import json
import sys

import torch
import torch.nn.functional as F

B = 1


def median_ms(fn, calls, samples=10):
    """Median ms per call over samples of `calls` back-to-back calls, as
    the Rust bench times them (its --calls)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    times.sort()
    return times[len(times) // 2]


def attention_kernels(fn):
    """The CUDA kernels of one call whose names say which SDPA backend ran
    (flash, memory-efficient, cuDNN)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    keys = ("flash", "fmha", "sdpa", "cudnn", "attention", "mha")
    return sorted(n[:120] for n in names if any(k in n.lower() for k in keys))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", default="2048,4096,8192,16384")
    parser.add_argument("--out")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--shapes", default="16x8x128,32x8x64")
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    rows = []
    for (HQ, HKV, D), seq in [(s, n) for s in shapes for n in (int(x) for x in args.seq.split(","))]:
        q = torch.randn(B, HQ, seq, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(B, HKV, seq, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(B, HKV, seq, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)

        def fwd():
            with torch.no_grad():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        def fwd_bwd():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            # Seeded with ones as the Rust bench seeds it; fresh gradients
            # (no accumulation into .grad), as Burn returns them.
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

        fwd_ms = median_ms(fwd, args.calls)
        torch.cuda.reset_peak_memory_stats()
        both_ms = median_ms(fwd_bwd, args.calls)
        peak = torch.cuda.max_memory_allocated() / 2**20
        kernels = attention_kernels(fwd_bwd)
        flops = 4.0 * B * HQ * D * seq * seq / 2
        row = {
            "shape": f"b{B} hq{HQ} hkv{HKV} d{D} causal",
            "seq": seq,
            "dtype": "bf16",
            "implementation": "torch sdpa",
            "fwd_ms": fwd_ms,
            "fwd_tflops": flops / fwd_ms / 1e9,
            "fwd_bwd_ms": both_ms,
            "fwd_bwd_tflops": 3.5 * flops / both_ms / 1e9,
            "peak_mib": peak,
            "kernels": kernels,
        }
        print(json.dumps(row), flush=True)
        print(
            f"attention hq{HQ} d{D} seq {seq:>6} torch    fwd {fwd_ms:9.3f} ms {row['fwd_tflops']:6.1f} TFLOP/s  "
            f"fwd+bwd {both_ms:9.3f} ms {row['fwd_bwd_tflops']:6.1f} TFLOP/s  peak {peak:8.0f} MiB",
            file=sys.stderr,
        )
        rows.append(row)
        del q, k, v
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "attention": rows}, f, indent=2)


if __name__ == "__main__":
    main()
