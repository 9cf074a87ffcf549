import json, sys, glob, collections
# rows: (seq, hdim, causal, pass) -> list of flash/torch ratios per tag group
groups = collections.defaultdict(lambda: collections.defaultdict(list))
for tag in sys.argv[1:]:
  grp = tag.rsplit("_r", 1)[0]
  for line in open(f"{tag}.md"):
    c = [x.strip() for x in line.split("|")]
    if len(c) > 10 and c[1].isdigit():
      key = (int(c[1]), int(c[2]), c[3], c[4])
      groups[key][grp].append((float(c[6]), float(c[8])))
grps = sorted({t.rsplit("_r", 1)[0] for t in sys.argv[1:]})
print("| seq | hd | causal | pass | " + " | ".join(f"{g} GFLOP/s (torch) ratio" for g in grps) + " |")
for key in sorted(groups):
  cells = []
  for g in grps:
    v = groups[key][g]
    ours = [a for a, b in v]; th = [b for a, b in v]; r = [a / b for a, b in v]
    cells.append(f"{sum(ours)/len(ours):.0f} ({sum(th)/len(th):.0f}) {min(r):.2f}-{max(r):.2f}x")
  print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | " + " | ".join(cells) + " |")
