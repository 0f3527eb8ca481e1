"""GPU time of the fused AdamW step in a kernel trace (`kernel_trace.c`'s
"K start end name" lines, xz-compressed): for the last 20 steps (a step
runs from its first gradient-norm kernel to its last update kernel), the
medians of the norm's, the clip factor's and the update's kernel time,
of all three, and of the step's span on the GPU (ms).

Usage: python3 step_busy.py k-adamw.txt.xz
"""
import os
import sys, lzma
rows=[]
for l in lzma.open(sys.argv[1],'rt'):
    p=l.split(' ',3)
    if p[0]=='K': rows.append((int(p[1]),int(p[2]),p[3].strip()))
rows.sort()
rel=[r for r in rows if 'adamw_kernel' in r[2] or 'sum_squares' in r[2] or 'clip_scale' in r[2]]
steps=[]; cur=[]; prev=None
for r in rel:
    if 'sum_squares' in r[2] and prev and 'adamw' in prev[2]:
        steps.append(cur); cur=[]
    cur.append(r); prev=r
steps.append(cur)
steps=steps[-20:]
import statistics as st
def tot(s,k): return sum(r[1]-r[0] for r in s if k in r[2])/1e6
print(os.path.basename(os.path.dirname(sys.argv[1])), "steps",len(steps),
 "norm %.3f"%st.median(tot(s,'sum_sq') for s in steps),
 "clip %.3f"%st.median(tot(s,'clip_scale') for s in steps),
 "update %.3f"%st.median(tot(s,'adamw') for s in steps),
 "busy %.3f"%st.median(sum(r[1]-r[0] for r in s)/1e6 for s in steps),
 "span %.2f"%st.median((s[-1][1]-s[0][0])/1e6 for s in steps),
 "min span %.2f"%min((s[-1][1]-s[0][0])/1e6 for s in steps))
