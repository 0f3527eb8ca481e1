"""The tables of this folder's README section, from the lease files (c1, c2
and c3 ran on one machine, one call after another) and, for the peers not
run again, from ../sweep-cudnn-h200/lease-1 and lease-2."""
import os, sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lease_tables import bastile, ms, sweep_shapes, torch  # noqa: E402

chunks = bastile("c1/*-sweep.json")
exact2 = bastile("c2/[34]-sweep.json")
chunks2 = bastile("c2/1[01]-sweep.json")
here_peers = torch("c2/*.jsonl")
here_peers.update(torch("c3/*.jsonl"))
old_peers = torch("../sweep-cudnn-h200/lease-1/*.jsonl")
old_peers.update(torch("../sweep-cudnn-h200/lease-2/*.jsonl"))
old_main = bastile("../sweep-cudnn-h200/lease-1/a1-*sweep.json")
names = {"HF transformers": "HF", "HF + Liger-Kernel": "Liger", "HF + torch.compile": "compile"}

print("| model | batch × tokens | Bastile (Chunks) ms | in use MiB | `Exact` in use MiB (sweep-cudnn) "
      "| HF + Liger in use MiB | best PyTorch row ms | best PyTorch ÷ Bastile |")
print("|---|---|---:|---:|---:|---:|---|---:|")
for model, batch, seq in sweep_shapes():
    b = chunks[(model, batch, seq)]
    best = None
    for impl in names:
        r = here_peers.get((model, batch, seq, impl))
        tag = "this lease"
        if r is None:
            r, tag = old_peers.get((model, batch, seq, impl)), "sweep-cudnn"
        if r and (best is None or r["ms_per_step"] < best[0]["ms_per_step"]):
            best = (r, f"{names[impl]}, {tag}")
    liger = old_peers[(model, batch, seq, "HF + Liger-Kernel")]
    print(f"| {model} | {batch} × {seq} | {ms(b)} | {b['in_use_mib']:.0f} | "
          f"{old_main[(model, batch, seq)]['in_use_mib']:.0f} | {liger['in_use_mib']:.0f} | "
          f"{best[0]['ms_per_step']:.1f} ({best[1]}) | {best[0]['ms_per_step'] / b['ms_per_step']:.2f}× |")
print()
print("Same lease, alternating (c2): Exact, then HF + Liger-Kernel, then Chunks:")
for k in sorted(exact2):
    e, c = exact2[k], chunks2[k]
    lg = here_peers[k + ("HF + Liger-Kernel",)]
    print(f"- {k}: Exact {ms(e)}, {e['in_use_mib']:.0f} MiB; HF + Liger {lg['ms_per_step']:.1f} ms, "
          f"{lg['in_use_mib']:.0f} MiB; Chunks {ms(c)}, {c['in_use_mib']:.0f} MiB "
          f"({lg['ms_per_step'] / c['ms_per_step']:.2f}× Liger)")
print()
print("torch.compile in this lease (c2, c3) against c1's Bastile:")
for k, r in sorted(here_peers.items()):
    if k[3] == "HF + torch.compile":
        b = chunks[k[:3]]
        print(f"- {k[:3]}: {r['ms_per_step']:.1f} ms, {r['in_use_mib']:.0f} MiB; Bastile {b['ms_per_step']:.1f} ms, "
              f"host {b.get('host_ms', float('nan')):.1f} ms ({r['ms_per_step'] / b['ms_per_step']:.2f}×)")
