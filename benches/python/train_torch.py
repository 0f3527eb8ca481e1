"""Training steps of a model preset through HF transformers, HF +
Liger-Kernel and HF under torch.compile as their users run them (the
attention HF picks by default for the model, SDPA for Qwen3 and Llama;
`AdamW(fused=True)`; gradient clipping at 1.0 as HF Trainer does), on the
same configuration as `bastile-bench --model <preset>`: random weights in
bf16, one micro-batch of random tokens per step, labels = ids. `--attn
eager` forces HF's eager attention instead, as earlier results used.
`--lora R` trains PEFT LoRA adapters of rank R (alpha 2R, no dropout) on
every linear projection (q, k, v, o, gate, up, down) of the frozen model,
and for GPT-OSS also on its router and both expert weights (PEFT's
`target_parameters`; its layers have no gate, up or down), as a PEFT user with HF Trainer's `bf16=True` runs it: the adapters in f32
(PEFT's default), the forward pass under bf16 autocast, AdamW and the
clip over the adapters only. `--checkpointing` turns on HF's gradient
checkpointing (`model.gradient_checkpointing_enable()`, as HF Trainer's
`gradient_checkpointing=True` does): every decoder layer recomputed in the
backward pass.

Each row reports the median step time and its range, the first step's time (compilation
included), the peak bytes in use during the timed steps
(`max_memory_allocated`) and the pool's peak reservation. Each
(implementation, batch, seq) runs in a fresh subprocess so its peak memory
starts from nothing; an out-of-memory failure is recorded as such. Prints
one JSON object per configuration.

Usage: python3 train_torch.py --model qwen3-0.6b --seq 4096 --batch 1 \
           [--impl hf liger compile] [--steps 5] [--out results.jsonl]
"""

import argparse
import json
import statistics
import subprocess
import sys
import time

# The presets of `bastile_models::presets` that this script knows, in HF
# config fields.
def qwen3(hidden, inter, layers, heads, kv_heads, tied=True):
    return dict(model_type="qwen3", hidden_size=hidden, intermediate_size=inter,
                num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads, head_dim=128, vocab_size=151936,
                tie_word_embeddings=tied, rope_theta=1000000.0, rms_norm_eps=1e-6,
                max_position_embeddings=40960)


def llama(hidden, inter, layers, heads, kv_heads, head_dim):
    return dict(model_type="llama", hidden_size=hidden, intermediate_size=inter,
                num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=128256,
                tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5,
                max_position_embeddings=131072,
                rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                  high_freq_factor=4.0,
                                  original_max_position_embeddings=8192))


def gpt_oss(layers):
    return dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880,
                num_hidden_layers=layers, num_attention_heads=64, num_key_value_heads=8,
                head_dim=64, vocab_size=201088, tie_word_embeddings=False,
                rope_theta=150000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
                attention_bias=True, num_local_experts=32, num_experts_per_tok=4,
                sliding_window=128, swiglu_limit=7.0,
                layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                             for i in range(layers)],
                rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0,
                                  beta_slow=1.0, truncate=False,
                                  original_max_position_embeddings=4096))


PRESETS = {
    "qwen3-0.6b": qwen3(1024, 3072, 28, 16, 8),
    "qwen3-1.7b": qwen3(2048, 6144, 28, 16, 8),
    "qwen3-8b": qwen3(4096, 12288, 36, 32, 8, tied=False),
    "llama-3.2-1b": llama(2048, 8192, 16, 32, 8, 64),
    "gpt-oss-20b-4l": gpt_oss(4),
    "gpt-oss-20b-8l": gpt_oss(8),
}

# Liger's patch for each model type.
LIGER = {"qwen3": "apply_liger_kernel_to_qwen3", "llama": "apply_liger_kernel_to_llama",
         "gpt_oss": "apply_liger_kernel_to_gpt_oss"}


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# What `bastile-bench --lora` adapts besides the projections: GPT-OSS's
# router and experts, which are parameters of modules, not linear layers.
LORA_PARAMETERS = {
    "gpt_oss": ["mlp.router.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
}


def name(impl, attn, lora=None, checkpointing=False):
    """The row's implementation, naming HF's attention where it was forced
    (every row records the attention that ran under "attention")."""
    base = {"hf": "HF transformers", "liger": "HF + Liger-Kernel",
            "compile": "HF + torch.compile"}[impl]
    base += f" ({attn})" if attn else ""
    base += f" + PEFT, LoRA r{lora}" if lora else ""
    return base + (", checkpointing every layer" if checkpointing else "")


def one(model_name, impl, batch, seq, steps, attn, lora=None, checkpointing=False):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(PRESETS[model_name])
    model_type = fields.pop("model_type")
    if impl == "liger":
        import liger_kernel.transformers as liger

        getattr(liger, LIGER[model_type])()
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(0)
    # None leaves HF's default for the model (what `from_pretrained` gives).
    # Initialized on the GPU: random weights of an 8B model take minutes on
    # the CPU, and where they come from does not change a step.
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            config, torch_dtype=torch.bfloat16, attn_implementation=attn
        )
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(
            r=lora, lora_alpha=2 * lora, lora_dropout=0.0, target_modules=LORA_TARGETS,
            target_parameters=LORA_PARAMETERS.get(model_type), task_type="CAUSAL_LM"))
    if checkpointing:
        model.config.use_cache = False
        model.gradient_checkpointing_enable()
        if lora:
            # What HF Trainer does for PEFT models: the frozen embeddings'
            # output requires grad, so the checkpointed layers get one.
            model.enable_input_require_grads()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, fused=True)
    # HF Trainer's bf16=True: autocast (PEFT's f32 adapters then multiply
    # in bf16, as Bastile's do); a full finetune of bf16 weights needs none.
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=bool(lora))
    # torch.compile as a user applies it: the model's forward compiled
    # (the backward through AOTAutograd), the optimizer step as it is.
    forward = torch.compile(model) if impl == "compile" else model
    ids = torch.randint(0, config.vocab_size, (batch, seq), device="cuda")
    times = []
    first_step_s = None
    for i in range(2 + steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with autocast:
            loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = loss.item()
        torch.cuda.synchronize()
        if i == 0:
            first_step_s = time.perf_counter() - t
        if i == 1:
            # The peaks of the timed steps only (the first step's
            # compilation buffers excluded).
            torch.cuda.reset_peak_memory_stats()
        if i >= 2:
            times.append(time.perf_counter() - t)
        print(f"step {i}: loss {loss_value:.4f}", file=sys.stderr)
    ms = statistics.median(times) * 1e3
    return {
        "model": model_name,
        "batch": batch,
        "seq": seq,
        "dtype": "bf16",
        "implementation": name(impl, attn, lora, checkpointing),
        "attention": model.config._attn_implementation,
        # How a mixture of experts ran (HF's default for the model).
        "experts": getattr(model.config, "_experts_implementation", None),
        "ms_per_step": ms,
        # The fastest and the slowest timed step: the median's spread.
        "ms_range": [min(times) * 1e3, max(times) * 1e3],
        "tokens_per_s": batch * seq / (ms / 1e3),
        **closing_fields(first_step_s),
    }


def closing_fields(first_step_s):
    """What every row ends with: this GPU's peak reservation and peak bytes
    in use since the last reset, the first step's time, and the GPU."""
    import torch

    return {
        "peak_mib": torch.cuda.max_memory_reserved() / 2**20,
        "in_use_mib": torch.cuda.max_memory_allocated() / 2**20,
        "first_step_s": first_step_s,
        "host_ms": None,
        "error": None,
        "device": torch.cuda.get_device_name(),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-0.6b", choices=sorted(PRESETS))
    p.add_argument("--seq", type=int, nargs="+", default=[4096])
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--impl", nargs="+", default=["hf", "liger", "compile"],
                   choices=["hf", "liger", "compile"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--attn", choices=["eager", "sdpa"],
                   help="force this attention (default: HF's default for the model)")
    p.add_argument("--lora", type=int, help="train PEFT LoRA adapters of this rank")
    p.add_argument("--checkpointing", action="store_true",
                   help="HF's gradient checkpointing of every decoder layer")
    p.add_argument("--out")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(one(a.model, a.impl[0], a.batch[0], a.seq[0], a.steps, a.attn, a.lora,
                             a.checkpointing)))
        return
    rows = []
    for batch in a.batch:
        # An implementation that fails at one length is not tried at longer
        # ones (as in the Rust sweep).
        failed = set()
        for seq in a.seq:
            for impl in (i for i in a.impl if i not in failed):
                cmd = [sys.executable, __file__, "--child", "--model", a.model, "--impl", impl,
                       "--batch", str(batch), "--seq", str(seq), "--steps", str(a.steps)]
                cmd += ["--attn", a.attn] if a.attn else []
                cmd += ["--lora", str(a.lora)] if a.lora else []
                cmd += ["--checkpointing"] if a.checkpointing else []
                r = subprocess.run(cmd, capture_output=True, text=True)
                sys.stderr.write(r.stderr[-2000:])
                line = next((l for l in r.stdout.splitlines() if l.startswith("{")), None)
                if line:
                    row = json.loads(line)
                else:
                    oom = "out of memory" in r.stderr.lower()
                    last = (r.stderr.strip().splitlines() or ["no output"])[-1]
                    row = {"model": a.model, "batch": batch, "seq": seq, "dtype": "bf16",
                           "implementation": name(impl, a.attn, a.lora, a.checkpointing),
                           "ms_per_step": None,
                           "tokens_per_s": None, "peak_mib": None, "in_use_mib": None,
                           "error": "out of memory" if oom else last}
                    failed.add(impl)
                print(json.dumps(row), flush=True)
                rows.append(row)
    if a.out:
        with open(a.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
