# Ratios jax_flash/torch per row over the runs of each build: python summary.py
import sys
sys.argv = ['x']
exec(open('/tmp/s45/compare.py').read().split('tags = sys.argv')[0])
import os
QUIET = os.environ.get('QUIET')
groups = {'base b4585c8': ['f32_base_r1', 'f32_base_r2', 'f32_base_r3', 'f32_base_r4', 'f32_base_r5', 'f32_base_r6'],
          'pairs': ['f32_pair_r1', 'f32_pair_r2', 'f32_pair_r3', 'f32_pair_r4', 'f32_pair_r5', 'f32_pair_r6']}
if QUIET:
    groups = {g: [t for t in ts if t[-1] in '456'] for g, ts in groups.items()}
data = {t: rows(t) for g in groups.values() for t in g}
keys = list(data[groups['base b4585c8'][0]].keys())
def stat(xs):
    return f'{min(xs):.2f}-{max(xs):.2f} (mean {sum(xs)/len(xs):.2f})'
print('| seq | hd | causal | pass | ' + ' | '.join(f'{g}: ratio' for g in groups) +
      ' | ' + ' | '.join(f'{g}: GFLOP/s ours / torch (means)' for g in groups) + ' |')
print('|---|---|---|---|' + '---|' * (2 * len(groups)))
for k in keys:
    cells, rates = [], []
    for g, ts in groups.items():
        ts = [t for t in ts if k in data[t]]
        cells.append(stat([float(data[t][k][2].rstrip('x')) for t in ts]))
        ours = [data[t][k][0] for t in ts]
        theirs = [float(data[t][k][1]) for t in ts]
        rates.append(f'{sum(ours)/len(ours):.1f} / {sum(theirs)/len(theirs):.1f}')
    print('| ' + ' | '.join(k) + ' | ' + ' | '.join(cells) + ' | ' + ' | '.join(rates) + ' |')
