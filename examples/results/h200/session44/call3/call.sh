#!/usr/bin/env bash
# Session 44, call 3 (written, not run: the session's device time was spent). Call 2 found that a
# TMA store whose box starts before row 0 is an illegal instruction (loads there are fine: zeros),
# the cause of the end-aligned tiles' three failures; the shift is now whole warpgroups' rows, so
# no store starts before row 0. Checks the end-aligned tiles (JAX_FLASH_CUDA_FWD_ROWS=end) on the
# reference cases of head dims 40-256 (odd lengths among them), the forward-only cases, the graph
# capture and the many-tiles cases, then with the direct stores of O and the 192-row tiles on
# every mask; then this tree's default on the NaN cases. If all pass, make the end-aligned tiles
# the default (gpu/kernel_choice.cu end_aligned_rows).
#   run from the repository root on the GPU machine: bash examples/results/h200/session44/call3/call.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-240} source .ci/gpu/call_preamble.sh  # (step)
ref="test_cuda_matches_reference or test_forward_only_matches_reference"
step end 90 env JAX_FLASH_CUDA_FWD_ROWS=end "${PT[@]}" -n 8 tests/test_cuda.py \
  -k "(($ref) and (h40 or h64 or h96 or h128 or h256)) or test_command_buffer_capture or test_forward_of_more_tiles_than_sms"
step end_variants 120 "${PT[@]}" tests/test_cuda.py -k "test_forward_end_aligned_rows_on_hopper"
step poison 30 "${PT[@]}" -n 8 tests/test_nan_propagation.py -k cuda
mv "$out"/*.log "$runs"/
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
