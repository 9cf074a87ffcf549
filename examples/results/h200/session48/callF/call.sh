#!/usr/bin/env bash
# Session 48, call F: head dim 256's forward at seq 1024-2048 on this machine from session 26's
# tree (a076682, whose table of record had it at 0.89-0.92x cuDNN on an H200) beside this tree's,
# each from its own package in its own process, cuDNN in each: whether the 0.70-0.73x of calls D
# and E is the H100's or a change since.
#   here: git archive a076682 | tar -x -C .old_tree; build it for the GPU machine's Python (sm_90a
#   is enough) and put its _native*.so in .old_tree/jax_flash/; carry .old_tree beside the prebuilt.
#   run from the repository root on the GPU machine: bash examples/results/h200/session48/callF/call.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-200} source .ci/gpu/call_preamble.sh  # (the prebuilt modules; runs, out, left)
ARGS=(--platform gpu --reps 5 --skip xla pallas tokamax --seqs 1024 2048 --head-dims 256 --causal ${CAUSAL:-both})
for tree in old new; do
  (( $(left) > 40 )) || { echo "== $tree: skipped (time)"; continue; }
  dir=$PWD; [[ $tree == old ]] && dir=$PWD/.old_tree
  (cd "$dir" && PYTHONPATH=$dir timeout -s KILL $(( $(left) - 10 )) python3 -m jax_flash.benchmark "${ARGS[@]}" \
    --out "$OLDPWD/$runs/$tree" 2>"$OLDPWD/$runs/${tree}_progress.log" >"$OLDPWD/$out/bench_$tree.md")
  echo "== $tree $(elapsed)"; grep -E "^\| [0-9]" "$out/bench_$tree.md" | cut -c1-110
done
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
