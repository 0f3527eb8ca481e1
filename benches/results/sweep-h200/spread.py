import re,sys,statistics
for f in sys.argv[1:]:
    rows={}
    cur=None
    for l in open(f):
        m=re.match(r'== train (.*)',l)
        if m: cur=(m.group(1).strip(),); rows[cur]=[]
        m=re.search(r'step \d+: .*?, ([\d.]+) ms \(host ([\d.]+) ms\)(.*)',l)
        if m and cur and 'warm-up' not in m.group(3): rows[cur].append(float(m.group(1)))
    for k,v in rows.items():
        if v: print(f.split('/')[-1], *k, 'median %.1f (%.1f–%.1f) n=%d'%(statistics.median(v),min(v),max(v),len(v)))
