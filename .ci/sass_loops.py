"""The loops of a kernel's SASS (cuobjdump -sass output) and what they execute: for each loop
(a backward branch), its address range, instruction count, wgmma products (HGMMA) and opcode
histogram; with --span, the instructions from its first product to its last (what issuing the
products costs). Counts are static: a loop holding both sides of a branch counts both.

  python3 .ci/sass_loops.py kernel.sass [--top 8] [--span]
"""

from __future__ import annotations

import argparse
import collections
import re

INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")
BACKWARD_BRANCH = re.compile(r"BRA(?:\.\w+)*\s+(?:[^,]*,\s*)?0x([0-9a-f]+)")


def instructions(text: str) -> list[tuple[int, str]]:
  """(address, instruction text) of every instruction in the listing."""
  return [(int(m.group(1), 16), m.group(2).strip()) for m in map(INSTRUCTION.match, text.split("\n")) if m]


def opcode(text: str) -> str:
  """The opcode without its predicate and modifiers (HGMMA.64x128x16.F32 -> HGMMA)."""
  return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def loops(code: list[tuple[int, str]]) -> list[tuple[int, int]]:
  """(first, last) instruction indices of each loop: a branch to an earlier address."""
  index = {address: i for i, (address, _) in enumerate(code)}
  found = []
  for i, (address, text) in enumerate(code):
    m = BACKWARD_BRANCH.search(text)
    if m and int(m.group(1), 16) < address and int(m.group(1), 16) in index:
      found.append((index[int(m.group(1), 16)], i))
  return found


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("sass")
  parser.add_argument("--top", type=int, default=8, help="the largest loops to show")
  parser.add_argument("--span", action="store_true", help="instructions from each loop's first product to its last")
  args = parser.parse_args()
  code = instructions(open(args.sass).read())
  print(f"{len(code)} instructions")
  for first, last in sorted(loops(code), key=lambda r: r[1] - r[0], reverse=True)[:args.top]:
    body = [opcode(text) for _, text in code[first:last + 1]]
    counts = collections.Counter(body)
    line = f"loop {code[first][0]:#x}-{code[last][0]:#x}: {len(body)} instructions, {counts['HGMMA']} HGMMA"
    if args.span and counts["HGMMA"]:
      products = [i for i, op in enumerate(body) if op == "HGMMA"]
      line += f", {products[-1] - products[0]} from the first HGMMA to the last"
    print(line)
    print("   ", ", ".join(f"{op} {n}" for op, n in counts.most_common(24)))


if __name__ == "__main__":
  main()
