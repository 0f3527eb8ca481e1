"""Kernel time by name of one HF (+ Liger) training step, as train_torch.py runs it."""
import sys, collections, torch
sys.path.insert(0, "benches/python")
import train_torch as tt
from transformers import AutoConfig, AutoModelForCausalLM
model_name, seq, impl = sys.argv[1], int(sys.argv[2]), sys.argv[3]
fields = dict(tt.PRESETS[model_name]); mt = fields.pop("model_type")
if impl == "liger":
    import liger_kernel.transformers as liger
    getattr(liger, tt.LIGER[mt])()
config = AutoConfig.for_model(mt, **fields)
with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16, attn_implementation=None)
model.train(); params = [p for p in model.parameters() if p.requires_grad]
opt = torch.optim.AdamW(params, lr=1e-5, fused=True)
ids = torch.randint(0, config.vocab_size, (1, seq), device="cuda")
def step():
    loss = model(input_ids=ids, labels=ids).loss; loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0); opt.step(); opt.zero_grad(set_to_none=True); loss.item()
for _ in range(3): step()
torch.cuda.synchronize()
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    step(); torch.cuda.synchronize()
agg = collections.defaultdict(lambda: [0.0, 0]); ev = []
for e in prof.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
        agg[e.name[:70]][0] += e.device_time; agg[e.name[:70]][1] += 1
tot = sum(v[0] for v in agg.values())
print(f"{impl} {model_name} {seq}: kernel time {tot/1e3:.1f} ms")
for k, (t, c) in sorted(agg.items(), key=lambda x: -x[1][0])[:45]:
    print(f"{t/1e3:8.2f} ms {c:5d}x {k}")
