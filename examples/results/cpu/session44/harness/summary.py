import sys
sys.argv=['x']
exec(open('/tmp/h44/compare.py').read().split('tags = sys.argv')[0])
groups = {'base 6d176b6': ['f32_base_r0','f32_base_q','f32_base_r1','f32_base_r2','f32_base_r3'],
          'v1 (all three)': ['f32_v1_r1','f32_v1_r2'], 'v2 (split + bwd pad)': ['f32_v2_r1','f32_v2_r2']}
data = {t: rows(t) for g in groups.values() for t in g}
keys = list(data['f32_base_q'].keys())
print('| seq | hd | causal | pass | ' + ' | '.join(groups) + ' |')
print('|---|---|---|---|' + '---|' * len(groups))
for k in keys:
    cells = []
    for g, ts in groups.items():
        rs = [float(data[t][k][2].rstrip('x')) for t in ts if k in data[t]]
        cells.append(f'{min(rs):.2f}-{max(rs):.2f} (mean {sum(rs)/len(rs):.2f})')
    print('| ' + ' | '.join(k) + ' | ' + ' | '.join(cells) + ' |')
