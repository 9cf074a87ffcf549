#!/usr/bin/env bash
# Session 45, call 1: correctness of the two experimental layouts of head dim 64's causal forward.
# (1) Session 44's call 3 (never run): the end-aligned tiles (JAX_FLASH_CUDA_FWD_ROWS=end, the shift
# whole warpgroups' rows since d9820c0) on the reference cases of head dims 40-256 (odd lengths
# among them), the forward-only cases, the graph capture and the many-tiles cases, then the
# switch's variants test (direct stores of O, the 192-row tiles on every mask); (2) the unseen
# blocks skipped (JAX_FLASH_CUDA_FWD_UNSEEN=skip, b74ec67), tiles from row 0 and from the end;
# (3) the NaN cases under the default and under both switches.
#   run from the repository root on the GPU machine: bash examples/results/h200/session45/call1/call.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-480} source .ci/gpu/call_preamble.sh  # (step)
ref="test_cuda_matches_reference or test_forward_only_matches_reference"
step end 100 env JAX_FLASH_CUDA_FWD_ROWS=end "${PT[@]}" -n 8 tests/test_cuda.py \
  -k "(($ref) and (h40 or h64 or h96 or h128 or h256)) or test_command_buffer_capture or test_forward_of_more_tiles_than_sms"
step skip 150 "${PT[@]}" -n 2 tests/test_cuda.py -k "test_forward_skips_unseen_blocks_on_hopper"
step poison 40 "${PT[@]}" -n 8 tests/test_nan_propagation.py -k cuda
step poison_skip_end 40 env JAX_FLASH_CUDA_FWD_UNSEEN=skip JAX_FLASH_CUDA_FWD_ROWS=end "${PT[@]}" -n 8 \
  tests/test_nan_propagation.py -k cuda
step end_variants 130 "${PT[@]}" -n 3 tests/test_cuda.py -k "test_forward_end_aligned_rows_on_hopper"
mv "$out"/*.log "$runs"/  # (at most 8 files come back: the logs in the tar)
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
