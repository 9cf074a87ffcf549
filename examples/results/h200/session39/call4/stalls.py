"""Stall samples of call 4's Nsight Compute source pages, summed by reason and by opcode.

  mkdir x && tar xzf out/gpu_runs.tgz -C x && python3 stalls.py x/gpu_runs [stall_wait]
"""
import collections
import csv
import re
import sys


def load(path):
  rows = list(csv.reader(open(path)))
  header = rows[1]
  return {h: i for i, h in enumerate(header)}, [r for r in rows[2:] if len(r) >= len(header)]


folder = sys.argv[1]
key = sys.argv[2] if len(sys.argv) > 2 else "stall_wait"
for who in ("ours", "cudnn"):
  idx, data = load(f"{folder}/src_{who}.csv")
  reasons = [h for h in idx if h.startswith("stall_") and "Not Issued" not in h]
  by_reason = collections.Counter({s: sum(int(r[idx[s]] or 0) for r in data) for s in reasons})
  total = sum(by_reason.values())
  print(f"{who}: {total} samples, {sum(int(r[idx['Instructions Executed']] or 0) for r in data)} instructions")
  for s, v in by_reason.most_common(8):
    print(f"  {s:24s} {v:7d} {100 * v / total:5.1f}%")
  by_op = collections.Counter()
  for r in data:
    by_op[re.sub(r"^\s*(@!?U?P\w+\s+)?", "", r[1]).split(" ")[0].split(".")[0]] += int(r[idx[key]] or 0)
  print(f"  {key} by opcode:", ", ".join(f"{op} {v}" for op, v in by_op.most_common(8)))
