import re, collections
def load(f, total):
  d = {}; ins = {}
  for line in open(f):
    m = re.match(r"\s+([0-9.]+)\s+:\s+([0-9a-f]+):\s+(.*)", line)
    if m: d[int(m.group(2), 16)] = float(m.group(1)) * total / 100; ins[int(m.group(2), 16)] = m.group(3).strip()
  return d, ins
a, ins = load("/tmp/s50cpu/perf2048.ann", 11650 / 41)
b, _ = load("/tmp/s50cpu/perf8192b.ann", 18197 / 48)
# regions of 0x200 bytes
ra = collections.Counter(); rb = collections.Counter()
for k, v in a.items(): ra[k // 0x200] += v
for k, v in b.items(): rb[k // 0x200] += v
print("total per unit", sum(a.values()), sum(b.values()))
rows = sorted(set(ra) | set(rb), key=lambda r: -(rb[r] - ra[r]))
for r in rows[:15]:
  print(hex(r * 0x200), f"{ra[r]:.1f} -> {rb[r]:.1f}  diff {rb[r]-ra[r]:+.1f}")
  top = sorted([k for k in b if k // 0x200 == r], key=lambda k: -(b[k] - a.get(k, 0)))[:4]
  for k in top: print("    ", hex(k), f"{a.get(k,0):.1f}->{b[k]:.1f}", ins[k] if k in ins else "")
