#!/usr/bin/env bash
# Session 46, call 2: the layouts the new default replaced, still behind their switches: the tiles
# from row 0 (JAX_FLASH_CUDA_FWD_ROWS=start) and every warpgroup computing every block
# (JAX_FLASH_CUDA_FWD_UNSEEN=compute), alone and together, on the reference cases (the suite's
# subprocess tests, in parallel); then head dim 64 causal at seq 1024-8192, the default against
# the session-45 default (start + compute), each in its own process with cuDNN and tokamax.
#   run from the repository root on the GPU machine: bash examples/results/h200/session46/call2/call.sh
set -uo pipefail
# (written for the tree with flip_defaults.diff applied: session 46 could not run it)
grep -q 'read_switch(kForwardRowsVariable, "end"' cuda/gpu/kernel_choice.cu ||
  { echo "apply examples/results/h200/session46/flip_defaults.diff first"; exit 1; }
BUDGET_S=${BUDGET_S:-560} source .ci/gpu/call_preamble.sh  # (step, bench_variants)
[[ ${TESTS:-yes} == yes ]] && step layouts 260 "${PT[@]}" -n 6 tests/test_cuda.py \
  -k "test_forward_query_tile_rows_on_hopper or test_forward_computes_unseen_blocks_on_hopper"
bench_variants ${VARIANT_S:-80} default=tree start_compute=JAX_FLASH_CUDA_FWD_ROWS=start,JAX_FLASH_CUDA_FWD_UNSEEN=compute -- \
  --seqs ${SEQS:-1024 2048 4096 8192} --head-dims 64 --causal yes
mkdir -p "$runs/logs" && mv "$out"/*.log "$runs/logs"/
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
