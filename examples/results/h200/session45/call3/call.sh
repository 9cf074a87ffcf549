#!/usr/bin/env bash
# Session 45, call 3: the layouts that calls 1-2 chose (ROWS, UNSEEN below: the end-aligned tiles
# and the unseen blocks skipped) under compute-sanitizer, memcheck and racecheck, on the odd
# head-dim-64 cases (each case a process, killed at 60 s), then the GPU suite's main file under
# them (its subprocess tests, which set their own switches, aside), each in a process of its own.
#   run from the repository root on the GPU machine: bash examples/results/h200/session45/call3/call.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-540} source .ci/gpu/call_preamble.sh  # (step)
export JAX_FLASH_CUDA_FWD_ROWS=${ROWS:-end} JAX_FLASH_CUDA_FWD_UNSEEN=${UNSEEN:-skip}
CS=/usr/local/cuda/bin/compute-sanitizer
for case in 4 5 18; do
  step memcheck_$case 60 $CS --tool memcheck --print-limit 4 python3 .ci/gpu/sanitize_cases.py --cases $case
  grep -E "SUMMARY" "$out/memcheck_$case.log"
done
for case in 5 18; do
  step racecheck_$case 60 $CS --tool racecheck --print-limit 4 python3 .ci/gpu/sanitize_cases.py --cases $case
  grep -E "SUMMARY" "$out/racecheck_$case.log"
done
step suite_cuda 200 "${PT[@]}" -n 14 tests/test_cuda.py -k "not on_hopper and not on_cuda"
step suite_nan 40 "${PT[@]}" -n 8 tests/test_nan_propagation.py -k cuda
mkdir -p "$runs/logs" && mv "$out"/*.log "$runs/logs"/
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
