#!/usr/bin/env bash
# Session 45, call 1 (the pool refused eight starts and took one call back mid-run: one short call
# where three were planned): the two experimental layouts of head dim 64's forward together, the
# end-aligned tiles (JAX_FLASH_CUDA_FWD_ROWS=end, the shift whole warpgroups' rows since d9820c0)
# and the unseen blocks skipped (JAX_FLASH_CUDA_FWD_UNSEEN=skip, b74ec67). (1) Both on the
# reference cases of head dims 40-128 (causal, windows, lengths, T != S), the forward-only cases,
# the graph capture and the many-tiles cases (the switch's test, its `end` case); (2) the NaN
# cases under both; (3) head dim 64 causal at seq 1024-8192: this tree's default and both
# layouts, each in its own process with cuDNN and tokamax.
# TESTS=no leaves out (1); BUDGET_S and VARIANT_S shorten it further.
#   run from the repository root on the GPU machine: bash examples/results/h200/session45/call1/call.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-380} source .ci/gpu/call_preamble.sh  # (step, bench_variants)
[[ ${TESTS:-yes} == yes ]] && step skip_end 110 "${PT[@]}" tests/test_cuda.py -k "test_forward_skips_unseen_blocks_on_hopper and end"
step poison_skip_end 40 env JAX_FLASH_CUDA_FWD_UNSEEN=skip JAX_FLASH_CUDA_FWD_ROWS=end "${PT[@]}" -n 8 \
  tests/test_nan_propagation.py -k cuda
bench_variants ${VARIANT_S:-75} default=tree end_skip=JAX_FLASH_CUDA_FWD_ROWS=end,JAX_FLASH_CUDA_FWD_UNSEEN=skip -- \
  --seqs ${SEQS:-1024 2048 4096 8192} --head-dims 64 --causal yes
mv "$out"/*.log "$runs"/  # (at most 8 files come back: the tables, and the logs in the tar)
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
