#!/usr/bin/env bash
# Session 44, call 3 (short: the session's device time nearly spent). Call 2 found that a TMA
# store whose box starts before row 0 is an illegal instruction (loads there are fine: zeros), the
# cause of the end-aligned tiles' three failures; the shift is now whole warpgroups' rows, no
# store starts before row 0, and the end-aligned tiles are the default. Checks the default on
# the reference cases of head dims 40-256 (odd lengths among them), the forward-only cases, the
# graph capture and the many-tiles cases, then its direct stores of O and the NaN cases.
#   run from the repository root on the GPU machine: bash examples/results/h200/session44/call3/call.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-200} source .ci/gpu/call_preamble.sh  # (step)
ref="test_cuda_matches_reference or test_forward_only_matches_reference"
step default 90 "${PT[@]}" -n 8 tests/test_cuda.py \
  -k "(($ref) and (h40 or h64 or h128 or h256)) or test_command_buffer_capture or test_forward_of_more_tiles_than_sms"
step directstore 60 "${PT[@]}" tests/test_cuda.py -k "test_forward_direct_store_on_hopper"
step poison 30 "${PT[@]}" -n 8 tests/test_nan_propagation.py -k cuda
mv "$out"/*.log "$runs"/
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
