"""How torch.topk orders equal router logits, the order HF's GPT-OSS router
takes its experts in (`torch.topk(router_logits, top_k, dim=-1)`), against
Bastile's rule for `router_top_k`: the larger logit first, the lower expert
index first among equal logits, NaN above every number.

Logits with ties: every entry one of a few values (or NaN). Prints, per
device, dtype and shape, how many rows torch ordered by that rule, by the
rule with the higher index first among equals, and how many rows hold the
rule's values in the rule's order whatever the indices.

Usage: python3 topk_ties.py [--out results.json]
"""
import argparse
import json

import torch


def by_rule(row, k, lower_first=True):
    """The rule's top-k indices of one row (a list of floats): NaN first,
    then larger values; among equal values the lower index first (or the
    higher, for the other rule tried)."""
    def key(i):
        v = row[i]
        return (0 if v != v else 1, -v if v == v else 0.0, i if lower_first else -i)
    return sorted(range(len(row)), key=key)[:k]


def same_values(row, got, k):
    """Whether torch's picks hold the same values, largest first, as the
    rule's (ties may pick other indices)."""
    def value(i):
        v = row[i]
        return "nan" if v != v else v
    return [value(i) for i in got] == [value(i) for i in by_rule(row, k)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    results = []
    gen = torch.Generator().manual_seed(0)
    for device in devices:
        for dtype in [torch.float32, torch.bfloat16]:
            for tokens, experts, k, values, nan in [
                (4096, 32, 4, 5, False),
                (4096, 32, 4, 2, False),
                (1024, 128, 8, 3, False),
                (1024, 32, 4, 5, True),
            ]:
                choice = torch.randint(0, values, (tokens, experts), generator=gen)
                logits = (choice.float() * 0.5 - 1.0)
                if nan:
                    logits[torch.rand(tokens, experts, generator=gen) < 0.05] = float("nan")
                logits = logits.to(dtype)
                _, got = torch.topk(logits.to(device), k, dim=-1)
                got = got.cpu().tolist()
                rows = logits.float().tolist()
                agree = sum(1 for r, g in zip(rows, got) if by_rule(r, k) == g)
                higher = sum(1 for r, g in zip(rows, got) if by_rule(r, k, False) == g)
                values_agree = sum(1 for r, g in zip(rows, got) if same_values(r, g, k))
                example = next(
                    ({"logits": r, "torch": g, "rule": by_rule(r, k)}
                     for r, g in zip(rows, got) if by_rule(r, k) != g), None)
                result = {
                    "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                    "dtype": str(dtype).replace("torch.", ""),
                    "tokens": tokens, "experts": experts, "k": k,
                    "distinct_values": values, "nan": nan,
                    "rows_by_rule": agree, "rows_higher_index_first": higher,
                    "rows_same_values": values_agree, "rows": tokens,
                }
                if example and tokens <= 1024 and experts == 32:
                    result["example"] = example
                print(json.dumps(result))
                results.append(result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
