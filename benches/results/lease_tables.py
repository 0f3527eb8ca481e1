"""Readers for the tables of a results folder: Bastile's rows from the
benchmark's JSON files and PyTorch's from train_torch.py's JSON lines,
both keyed by shape. Patterns are relative to the folder of the script
that runs."""
import glob, json, os, sys

here = os.path.dirname(os.path.abspath(sys.argv[0]))


def bastile(pattern):
    """(model, batch, seq) -> row, from `pattern`'s files."""
    rows = {}
    for f in sorted(glob.glob(os.path.join(here, pattern))):
        for r in json.load(open(f))["train"]:
            rows[(r["model"], r["batch"], r["seq"])] = r
    return rows


def torch(pattern):
    """(model, batch, seq, implementation) -> row."""
    rows = {}
    for f in sorted(glob.glob(os.path.join(here, pattern))):
        for line in open(f):
            r = json.loads(line)
            rows[(r["model"], r["batch"], r["seq"], r["implementation"])] = r
    return rows


def ms(r):
    """A row's median step time with its range."""
    lo, hi = r["ms_range"]
    return f"{r['ms_per_step']:.1f} ({lo:.1f}–{hi:.1f})"


def sweep_shapes():
    """(model, batch, seq) of the all-lengths sweeps, in table order."""
    for model in ["qwen3-0.6b", "llama-3.2-1b"]:
        for batch in [1, 4]:
            for seq in [1024, 2048, 4096, 8192]:
                yield model, batch, seq
