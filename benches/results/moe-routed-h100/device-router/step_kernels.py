"""One training step of a kernel trace (`benches/cupti/kernel_trace.c`'s
"K start end name" lines): the steps end at the last AdamW launch of a run
of them; prints the chosen step's span, GPU busy time, kernel time by name
and the largest idle gaps with the kernels around them.

Usage: python3 step_kernels.py kernels.txt [STEP (default -3: the third
from last)] [NAMES (default 40)]
"""
import sys, collections
ks=[]
for l in open(sys.argv[1]):
    p=l.rstrip("\n").split(" ",3)
    if p[0]=="K": ks.append((int(p[1]),int(p[2]),p[3] if len(p)>3 else ""))
ks.sort()
# step ends: last adamw of a run of adamw kernels
ends=[]
for i,(s,e,n) in enumerate(ks):
    if n.startswith("adamw") and (i+1==len(ks) or not ks[i+1][2].startswith("adamw")):
        ends.append(i)
print("steps found", len(ends))
which=int(sys.argv[2]) if len(sys.argv)>2 else -3
a=ends[which-1]+1; b=ends[which]
seg=ks[a:b+1]
t0=seg[0][0]; t1=seg[-1][1]
busy=0; ce=None; cs=None; gaps=[]
for i,(s,e,n) in enumerate(seg):
    if ce is None: cs,ce=s,e; continue
    if s>ce:
        busy+=ce-cs; gaps.append((s-ce, i)); cs,ce=s,e
    else: ce=max(ce,e)
busy+=ce-cs
print(f"step span {(t1-t0)/1e6:.1f} ms, busy {busy/1e6:.1f} ms, kernels {len(seg)}")
agg=collections.defaultdict(lambda:[0,0])
for s,e,n in seg:
    k=n[:60]; agg[k][0]+=e-s; agg[k][1]+=1
for k,(t,c) in sorted(agg.items(), key=lambda x:-x[1][0])[:int(sys.argv[3]) if len(sys.argv)>3 else 40]:
    print(f"{t/1e6:8.2f} ms {c:5d}x {k}")
gaps.sort(reverse=True)
print("largest gaps:")
for g,i in gaps[:15]:
    print(f"{g/1e6:7.2f} ms at {(seg[i][0]-t0)/1e6:7.1f} before {seg[i][2][:50]} after {seg[i-1][2][:50]}")
print("total gap", sum(g for g,_ in gaps)/1e6)
