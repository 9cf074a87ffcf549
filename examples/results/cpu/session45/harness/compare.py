# Ratios flash/torch per row across runs: python compare.py TAG1 TAG2 ...
import json, sys, re
def rows(tag):
    out = {}
    for line in open(f'/tmp/s45/runs/{tag}/stdout'):
        if not line.startswith('| ') or 'seq' in line or '---' in line: continue
        c = [x.strip() for x in line.strip().strip('|').split('|')]
        key = (c[0], c[1], c[2], c[3])
        out[key] = (float(c[5]), c[7], c[9])
    return out
tags = sys.argv[1:]
data = {t: rows(t) for t in tags}
keys = list(data[tags[0]].keys())
print('| seq | hd | causal | pass | ' + ' | '.join(f'{t} GF/s (torch) ratio' for t in tags) + ' |')
for k in keys:
    cells = []
    for t in tags:
        g, tg, r = data[t].get(k, (0, '-', '-'))
        cells.append(f'{g:.1f} ({tg}) {r}')
    print('| ' + ' | '.join(k) + ' | ' + ' | '.join(cells) + ' |')
