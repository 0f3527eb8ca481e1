"""PyTorch side of `cargo xtask bench --op linear-cross-entropy`: the same loss on the same
GPU through PyTorch (cuBLAS), for the comparison table.

Implementations, each forward + backward of the mean cross-entropy over the
non-padding tokens of `hidden @ weight.T`:
  * `torch`: the usual composite (bf16 logits, upcast to f32, F.cross_entropy);
  * `liger`: Liger-Kernel's fused linear cross-entropy (if importable);
  * `torch bare matmuls`: the three matmuls alone (logits, d_hidden, d_weight).

Peak memory is `torch.cuda.max_memory_allocated` during one call
(`peak_mib`, inputs included) and what the inputs hold (`inputs_mib`). Prints one JSON object per row on stdout.

Usage: python3 flce_torch.py [--shapes 8192x4096x151936,...] [--samples 5]
"""

import argparse
import json
import statistics

import torch
import torch.nn.functional as F


def data(n, h, v, device):
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, h, device=device, generator=g).bfloat16()
    weight = (torch.randn(v, h, device=device, generator=g) / h**0.5).bfloat16()
    labels = torch.randint(0, v, (n,), device=device, generator=g)
    labels[::10] = -100  # every 10th token is padding, as in the Rust bench
    return hidden, weight, labels


def composite(hidden, weight, labels):
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    logits = h @ w.T
    loss = F.cross_entropy(logits.float(), labels, ignore_index=-100)
    loss.backward()
    return h.grad, w.grad


def bare(hidden, weight, labels):
    logits = hidden @ weight.T
    return logits @ weight, logits.T @ hidden


def liger():
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except Exception as e:  # noqa: BLE001 - report why and go on
        print(json.dumps({"note": f"liger-kernel not importable: {e}"}))
        return None
    loss_fn = LigerFusedLinearCrossEntropyLoss(ignore_index=-100)

    def run(hidden, weight, labels):
        h = hidden.detach().requires_grad_()
        w = weight.detach().requires_grad_()
        loss = loss_fn(w, h, labels)
        loss.backward()
        return h.grad, w.grad

    return run


def measure(fn, args, samples):
    device = args[0].device
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    kept = fn(*args)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(device) - base
    del kept
    times = []
    for _ in range(samples):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        del out
    return statistics.median(times), peak


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="8192x4096x151936,16384x4096x151936,8192x1024x151936")
    p.add_argument("--samples", type=int, default=5)
    a = p.parse_args()
    device = torch.device("cuda")
    runs = [("torch", composite), ("torch bare matmuls", bare)]
    lg = liger()
    if lg is not None:
        runs.insert(1, ("liger", lg))
    for shape in a.shapes.split(","):
        n, h, v = (int(x) for x in shape.split("x"))
        args = data(n, h, v, device)
        inputs = torch.cuda.memory_allocated(device)
        for name, fn in runs:
            fn(*args)  # warm-up: Triton compilation, cuBLAS heuristics
            ms, peak = measure(fn, args, a.samples)
            flops = 3 * 2 * n * h * v
            print(
                json.dumps(
                    {
                        "shape": f"N={n} H={h} V={v}",
                        "dtype": "bf16",
                        "implementation": name,
                        "ms": ms,
                        "tflops": flops / (ms * 1e-3) / 1e12,
                        "peak_mib": (inputs + peak) / 2**20,
                        "inputs_mib": inputs / 2**20,
                        "device": torch.cuda.get_device_name(device),
                    }
                ),
                flush=True,
            )
        del args
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
