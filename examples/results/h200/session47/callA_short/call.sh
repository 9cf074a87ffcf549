#!/usr/bin/env bash
# Session 47, call A cut to what ~260 s of device time holds (the pool had refused every
# start by then): with flip_defaults.diff applied, compute-sanitizer memcheck on the odd
# head-dim-64 case 18 (the 192-row tiles the new default changes), the GPU suite's main file
# (its subprocess tests aside), then the NaN cases.
#   run from the repository root on the GPU machine: bash examples/results/h200/session47/callA_short/call.sh
set -uo pipefail
grep -q 'read_switch(kForwardRowsVariable, "end"' cuda/gpu/kernel_choice.cu ||
  { echo "apply examples/results/h200/session47/flip_defaults.diff first"; exit 1; }
BUDGET_S=${BUDGET_S:-250} source .ci/gpu/call_preamble.sh  # (step)
step memcheck_18 55 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --print-limit 4 \
  python3 .ci/gpu/sanitize_cases.py --cases 18
grep -E "SUMMARY" "$out/memcheck_18.log"
step suite_cuda 150 "${PT[@]}" -n 14 tests/test_cuda.py -k "not on_hopper and not on_cuda"
step suite_nan 35 "${PT[@]}" -n 8 tests/test_nan_propagation.py -k cuda
echo "== done $(elapsed)"
