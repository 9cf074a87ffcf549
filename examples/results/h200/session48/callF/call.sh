#!/usr/bin/env bash
# Session 48, call F: head dim 256's forward at seq 1024-2048 on this machine from session 26's
# tree (a076682, whose table of record had it at 0.89-0.92x cuDNN on an H200) beside e1996ef's
# modules (the plain kernels of calls D and E), each from its own package in its own process,
# cuDNN in each: whether the 0.70-0.73x of calls D and E is the H100's or a change since.
#   here: git archive a076682 | tar -x -C .old_tree; build it for the GPU machine's Python
#   (sm_90a is enough), its _native*.so into .old_tree/jax_flash/ (build/ removed); NEW_MODULES
#   (default build/f_new): e1996ef's _native_cuda (xz) and _native; carry both.
#   run from the repository root on the GPU machine: bash examples/results/h200/session48/callF/call.sh
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=$PWD/gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
nvidia-smi --query-gpu=name --format=csv,noheader
bash .ci/gpu/package_copy.sh /tmp/new "${NEW_MODULES:-build/f_new}"
ARGS=(--platform gpu --reps 5 --skip xla pallas tokamax --seqs 1024 2048 --head-dims 256 --causal ${CAUSAL:-both})
for tree in old new; do
  dir=/tmp/new; [[ $tree == old ]] && dir=$PWD/.old_tree
  (cd "$dir" && PYTHONPATH=$dir timeout -s KILL ${TREE_S:-80} python3 -m jax_flash.benchmark "${ARGS[@]}" \
    --out "$runs/$tree" 2>"$runs/${tree}_progress.log" >"$runs/bench_$tree.md")
  cp "$runs/bench_$tree.md" "$out/"
  echo "== $tree $(elapsed)"; grep -E "^\| [0-9]" "$runs/bench_$tree.md" | cut -c1-110
done
tar czf "$out/gpu_runs.tgz" -C "$(dirname "$runs")" "$(basename "$runs")"
echo "== done $(elapsed)"
