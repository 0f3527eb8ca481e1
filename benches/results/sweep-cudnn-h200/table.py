"""The tables of this folder's README section, from the lease files."""
import os, sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lease_tables import bastile, ms, sweep_shapes, torch  # noqa: E402

main = bastile("lease-1/a1-*sweep.json")
chunks = bastile("lease-3/c6-*sweep.json")
peers = torch("lease-1/*.jsonl")
peers.update(torch("lease-2/*.jsonl"))
peers3 = torch("lease-3/*.jsonl")
print("| model | batch × tokens | Bastile ms | HF ms | HF + Liger ms | HF + compile ms | best PyTorch ÷ Bastile "
      "| Bastile in use MiB | HF + Liger in use MiB | Chunks build ms (lease 3) | its in use MiB |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for model, batch, seq in sweep_shapes():
    b = main[(model, batch, seq)]
    get = lambda impl: peers.get((model, batch, seq, impl))
    hf, lg, cp = get("HF transformers"), get("HF + Liger-Kernel"), get("HF + torch.compile")
    best = min(r["ms_per_step"] for r in (hf, lg, cp) if r)
    c = chunks[(model, batch, seq)]
    f = lambda r: f"{r['ms_per_step']:.1f}" if r else "not run"
    print(f"| {model} | {batch} × {seq} | {ms(b)} | {f(hf)} | {f(lg)} | {f(cp)} | "
          f"{best / b['ms_per_step']:.2f}× | {b['in_use_mib']:.0f} | {lg['in_use_mib']:.0f} | "
          f"{ms(c)} | {c['in_use_mib']:.0f} |")
print()
print("Lease 3's PyTorch rows:")
for k, r in sorted(peers3.items()):
    c = chunks[k[:3]]
    print(f"- {k}: {r['ms_per_step']:.1f} ms, {r['in_use_mib']:.0f} MiB; the Chunks build {c['ms_per_step']:.1f} ms "
          f"({r['ms_per_step'] / c['ms_per_step']:.2f}×)")
