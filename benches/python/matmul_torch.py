"""cuBLAS matmul throughput through PyTorch on the same shapes as
`cargo xtask bench --op matmul`, for the side-by-side table.

Prints one JSON object per row on stdout (progress on stderr).

Usage: python3 matmul_torch.py [--out results.json]
"""

import argparse
import json
import sys

import torch

SHAPES = [
    ("square", 1, 8192, 8192, 8192),
    ("mlp", 1, 16384, 4096, 4096),
    ("lm_head", 1, 8192, 1024, 151936),
    ("qwen3-0.6b q_proj", 1, 4096, 1024, 2048),
    ("attn scores", 16, 4096, 128, 4096),
    ("attn values", 16, 4096, 4096, 128),
]


def median_ms(fn, samples=15, iters=3):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    times.sort()
    return times[len(times) // 2]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = []
    for name, b, m, k, n in SHAPES:
        lhs = torch.randn(b, m, k, device="cuda", dtype=torch.bfloat16)
        rhs = torch.randn(b, k, n, device="cuda", dtype=torch.bfloat16)
        # Calls per sample as in the Rust bench: ~2 TFLOP of work, 3 to 64.
        flops = 2.0 * b * m * k * n
        iters = min(max(-(-2e12 // flops), 3), 64)
        ms = median_ms(lambda: torch.matmul(lhs, rhs), iters=int(iters))
        tflops = 2.0 * b * m * k * n / (ms * 1e-3) / 1e12
        shape = f"{name} {b}×{m}×{k}×{n}"
        print(f"{shape:<34} torch (cuBLAS) {ms:9.3f} ms {tflops:7.1f} TFLOP/s", file=sys.stderr)
        row = dict(shape=shape, dtype="bf16", implementation="torch (cuBLAS)", ms=ms, tflops=tflops)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, matmul=rows), f, indent=2)


if __name__ == "__main__":
    main()
