#!/usr/bin/env bash
# Session 49, call B (written; not run: the pool started no machine after call A): head dim
# 256's short forward, the bisection's second round, a candidate fix and its tests in one call.
# Call A put the loss after 5502214 (474 TFLOP/s at seq 1024 non-causal under either turn order,
# a076682 478, ccd15f0 415) and showed the per-tile turns do not recover it. The SASS of the bf16
# hd256 wide kernel (cuobjdump here) stays at 8168-8176 instructions and 4-6 barrier sites from
# 5502214 through dcb12f4, and grows to 9176 and 46 at b74ec67 (the skip of unseen blocks, then
# behind its switch, off). The tree it runs: main with ../skip_192_rows.diff applied (the skip
# compiled into the 192-row tiles' kernels only, Sm90FwdWsTraits::kSkipsUnseenBlocks; its hd256
# kernel back to 8176 instructions).
#   1. Head dim 256, seq 1024-2048: a076682 and b74ec67, each from its own package in its own
#      process, then this tree; cuDNN in each process.
#   2. This tree's GPU tests: the suite's main file.
#   3. Head dim 128, seq 1024 and 4096: 9f193ed (main's kernels: the skip in every kernel)
#      against this tree, and the runs with every block computed (JAX_FLASH_CUDA_FWD_UNSEEN=compute),
#      as long as the call's budget (BUDGET_S, default 480) lasts.
#   here: git apply examples/results/h200/session49/skip_192_rows.diff;
#         bash .ci/gpu/prebuilt.sh build && bash .ci/gpu/prebuilt.sh pack;
#         bash .ci/gpu/tree_at.sh C .trees/C for a076682 and b74ec67, and
#         bash .ci/gpu/tree_at.sh 9f193ed .trees/x1_noturns; carry build/prebuilt_xz and the trees.
#   run from the repository root on the GPU machine: bash examples/results/h200/session49/callB/call.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-480}
source .ci/gpu/call_preamble.sh

ARGS=(--platform gpu --reps 5 --skip xla pallas tokamax --seqs 1024 2048 --head-dims 256 --causal both)
trees=()
for name in a076682 b74ec67; do
  [[ -d .trees/$name ]] && trees+=(".trees/$name")
done
TREE_S=50 bash .ci/gpu/bench_trees.sh "${trees[@]}" -- "${ARGS[@]}"
bench_variants 50 hd256=tree -- --skip xla pallas tokamax --seqs 1024 2048 --head-dims 256 --causal both
step suite 160 "${PT[@]}" -n 14 tests/test_cuda.py -k "not on_hopper and not on_cuda"
if (( $(left) > 90 )); then
  LABEL_SUFFIX=_hd64_128 TREE_S=40 bash .ci/gpu/bench_trees.sh .trees/x1_noturns -- \
    --platform gpu --reps 5 --skip xla pallas tokamax --seqs 1024 4096 --head-dims 128 --causal both
  bench_variants 40 hd128=tree -- --skip xla pallas tokamax --seqs 1024 4096 --head-dims 128 --causal both
fi
step unseen 150 "${PT[@]}" -n 2 tests/test_cuda.py -k test_forward_computes_unseen_blocks_on_hopper
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
