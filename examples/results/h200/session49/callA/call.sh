#!/usr/bin/env bash
# Session 49, call A: head dim 256's short forward, bisected. Session 48's call F measured
# a076682 (session 26) at 465 TFLOP/s and e1996ef at 360 (seq 1024, non-causal, one H100).
#   1. This tree's per-tile turns (JAX_FLASH_CUDA_FWD_TURNS=per_tile, written in session 48, not
#      yet run): its GPU test, then the default and per_tile side by side at head dim 256,
#      seq 1024-2048, and at head dims 64/128, seq 1024 and 4096.
#   2. Nine earlier trees, each from its own package in its own process, cuDNN in each, at head
#      dim 256, seq 1024-2048: a076682 (fast), b813c9b, 8ce4092, 2b6413c, fec265d, 5502214 (under
#      both turn orders; its default is per_tile), 296c855, dcb12f4, b74ec67.
#   (As run, only .trees/a076682 and .trees/5502214 were carried: the loop takes the trees present.)
#   here: bash .ci/gpu/prebuilt.sh build && bash .ci/gpu/prebuilt.sh pack;
#         bash .ci/gpu/tree_at.sh C .trees/C for each tree; carry build/prebuilt_xz and .trees.
#   run from the repository root on the GPU machine: bash examples/results/h200/session49/callA/call.sh
set -uo pipefail
source .ci/gpu/call_preamble.sh

step per_tile_test 150 "${PT[@]}" tests/test_cuda.py -k per_tile_turns
bench_variants 80 default=tree per_tile=JAX_FLASH_CUDA_FWD_TURNS=per_tile -- \
  --skip xla pallas tokamax --seqs 1024 2048 --head-dims 256 --causal both
bench_variants 80 default64=tree per_tile64=JAX_FLASH_CUDA_FWD_TURNS=per_tile -- \
  --skip xla pallas tokamax --seqs 1024 4096 --head-dims 64 128 --causal both

ARGS=(--platform gpu --reps 5 --skip xla pallas tokamax --seqs 1024 2048 --head-dims 256 --causal both)
trees=()
for commit in a076682 b813c9b 8ce4092 2b6413c fec265d 5502214 296c855 dcb12f4 b74ec67; do
  [[ -d .trees/$commit ]] && trees+=(".trees/$commit")
done
TREE_S=50 bash .ci/gpu/bench_trees.sh "${trees[@]}" -- "${ARGS[@]}"
JAX_FLASH_CUDA_FWD_TURNS=across_tiles LABEL_SUFFIX=_across_tiles TREE_S=50 \
  bash .ci/gpu/bench_trees.sh .trees/5502214 -- "${ARGS[@]}"

echo "== done $(elapsed)"
