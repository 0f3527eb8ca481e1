"""Writes the RoPE reference tables of HF transformers for the configs
Bastile supports (default, Llama 3 "llama3" scaling, GPT-OSS YaRN), so the
Rust tests can check `bastile::nn::rope_frequencies` and `RopeTables`
against them.

Usage: python3 scripts/rope_fixtures.py OUT.json   (needs torch + transformers)
"""

import json
import sys

import torch
import transformers

POSITIONS = [0, 1, 17, 1000, 4095, 70000]


def rotary(module_name, class_name, config_name, **kwargs):
    mod = __import__(f"transformers.models.{module_name}.modeling_{module_name}", fromlist=[class_name])
    cfg_mod = __import__(f"transformers.models.{module_name}.configuration_{module_name}", fromlist=[config_name])
    scaling = kwargs.pop("rope_scaling", None)
    theta = kwargs.pop("rope_theta")
    try:
        # transformers >= 5: rope_parameters carries theta and scaling together.
        params = dict(scaling or {"rope_type": "default"})
        params["rope_theta"] = theta
        cfg = getattr(cfg_mod, config_name)(rope_parameters=params, **kwargs)
        emb = getattr(mod, class_name)(config=cfg)
    except TypeError:
        cfg = getattr(cfg_mod, config_name)(rope_theta=theta, rope_scaling=scaling, **kwargs)
        emb = getattr(mod, class_name)(config=cfg)
    return emb


def entry(emb, head_dim):
    x = torch.zeros(1, len(POSITIONS), head_dim, dtype=torch.float32)
    pos = torch.tensor([POSITIONS])
    cos, sin = emb(x, pos)
    half = head_dim // 2
    return {
        "head_dim": head_dim,
        "inv_freq": emb.inv_freq.float().tolist(),
        "attention_scaling": float(emb.attention_scaling),
        "positions": POSITIONS,
        "cos": cos[0, :, :half].float().tolist(),
        "sin": sin[0, :, :half].float().tolist(),
    }


def main():
    out = {"transformers": transformers.__version__, "torch": torch.__version__}
    out["qwen3_default"] = entry(
        rotary("qwen3", "Qwen3RotaryEmbedding", "Qwen3Config",
               rope_theta=1_000_000.0, head_dim=128, hidden_size=1024,
               num_attention_heads=16, max_position_embeddings=40960),
        128,
    )
    out["llama3"] = entry(
        rotary("llama", "LlamaRotaryEmbedding", "LlamaConfig",
               rope_theta=500_000.0, head_dim=64, hidden_size=2048,
               num_attention_heads=32, max_position_embeddings=131072,
               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
        64,
    )
    out["gpt_oss_yarn"] = entry(
        rotary("gpt_oss", "GptOssRotaryEmbedding", "GptOssConfig",
               rope_theta=150_000.0, head_dim=64, hidden_size=2880,
               num_attention_heads=64, max_position_embeddings=131072,
               rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "original_max_position_embeddings": 4096, "truncate": False}),
        64,
    )
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)
    print("wrote", sys.argv[1], "transformers", transformers.__version__)


if __name__ == "__main__":
    main()
