#!/usr/bin/env bash
# Session 45, call 1 (the pool refused five starts first: one call where two were planned): the two
# experimental layouts of head dim 64's forward together, the end-aligned tiles
# (JAX_FLASH_CUDA_FWD_ROWS=end, the shift whole warpgroups' rows since d9820c0) and the unseen
# blocks skipped (JAX_FLASH_CUDA_FWD_UNSEEN=skip, b74ec67). (1) The end-aligned tiles on the
# reference cases of head dims 40-128 (odd lengths among them), the forward-only cases, the graph
# capture and the many-tiles cases; (2) the same with the skip too (the switch's test, its `end`
# case); (3) the NaN cases under both; (4) head dim 64's forward, causal and not, at seq 1024-8192:
# this tree's default and both layouts, each in its own process with cuDNN and tokamax.
#   run from the repository root on the GPU machine: bash examples/results/h200/session45/call1/call.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-540} source .ci/gpu/call_preamble.sh  # (step, bench_variants)
ref="test_cuda_matches_reference or test_forward_only_matches_reference"
step end 80 env JAX_FLASH_CUDA_FWD_ROWS=end "${PT[@]}" -n 8 tests/test_cuda.py \
  -k "(($ref) and (h40 or h64 or h128)) or test_command_buffer_capture or test_forward_of_more_tiles_than_sms"
step skip_end 100 "${PT[@]}" tests/test_cuda.py -k "test_forward_skips_unseen_blocks_on_hopper and end"
step poison_skip_end 40 env JAX_FLASH_CUDA_FWD_UNSEEN=skip JAX_FLASH_CUDA_FWD_ROWS=end "${PT[@]}" -n 8 \
  tests/test_nan_propagation.py -k cuda
seqs=${SEQS:-1024 2048 4096 8192}
bench_variants 110 default=tree end_skip=JAX_FLASH_CUDA_FWD_ROWS=end,JAX_FLASH_CUDA_FWD_UNSEEN=skip -- \
  --seqs $seqs --head-dims 64 --causal both
mv "$out"/*.log "$runs"/  # (at most 8 files come back: the tables, and the logs in the tar)
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
