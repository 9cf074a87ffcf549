#!/usr/bin/env bash
# Session 46, call 1: the end-aligned tiles and the unseen blocks skipped, now the default
# (JAX_FLASH_CUDA_FWD_ROWS=end, JAX_FLASH_CUDA_FWD_UNSEEN=skip): compute-sanitizer memcheck and
# racecheck on the odd head-dim-64 cases (each case a process, killed at 60 s), the GPU suite's
# main file (its subprocess tests, which set their own switches, aside; call 2 runs those) and
# the NaN cases, each in a process of its own.
#   run from the repository root on the GPU machine: bash examples/results/h200/session46/call1/call.sh
set -uo pipefail
# (written for the tree with flip_defaults.diff applied: session 46 could not run it)
grep -q 'read_switch(kForwardRowsVariable, "end"' cuda/gpu/kernel_choice.cu ||
  { echo "apply examples/results/h200/session46/flip_defaults.diff first"; exit 1; }
BUDGET_S=${BUDGET_S:-560} source .ci/gpu/call_preamble.sh  # (step)
step suite_cuda 220 "${PT[@]}" -n 14 tests/test_cuda.py -k "not on_hopper and not on_cuda"
step suite_nan 40 "${PT[@]}" -n 8 tests/test_nan_propagation.py -k cuda
CS=/usr/local/cuda/bin/compute-sanitizer
# (case 18 first under both tools: the 192-row tiles the new default changes; then 4 and 5)
for check in memcheck:18 racecheck:18 memcheck:4 memcheck:5 racecheck:5; do
  tool=${check%%:*} case=${check#*:}
  step ${tool}_$case 60 $CS --tool $tool --print-limit 4 python3 .ci/gpu/sanitize_cases.py --cases $case
  grep -E "SUMMARY" "$out/${tool}_$case.log"
done
mkdir -p "$runs/logs" && mv "$out"/*.log "$runs/logs"/
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
