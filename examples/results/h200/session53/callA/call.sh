#!/usr/bin/env bash
# Session 53's call A, for the next session with device time (session 53 had none: 106 s of
# budget, no machine could start). The tests of the 16-byte O stores as the default (937f03e
# flipped JAX_FLASH_CUDA_FWD_STORES after session 52's calls ran the path under the variable)
# and of the epilogue's one per-row helper (gpu/epilogue.cuh output_row, used by both store
# paths since session 53), named one by one (-vv: PERF_NOTES item 0000); racecheck on two
# sanitize cases; then head dim 256's table on an H200 beside session 51's call A.
# Needs: this tree's modules (`bash .ci/gpu/prebuilt.sh build && bash .ci/gpu/prebuilt.sh
# pack`), carry ["build/prebuilt_xz"]; run from the repository root on the GPU machine:
#   bash examples/results/h200/session53/callA/call.sh
export BUDGET_S=${BUDGET_S:-570}; set -uo pipefail; source .ci/gpu/call_preamble.sh
step main_selection 150 "${PT[@]}" -vv -n 10 -rf tests/test_cuda.py tests/test_nan_propagation.py -k "not on_hopper and not on_cuda"
step pair_stores 150 "${PT[@]}" -vv -n 2 -rf tests/test_cuda.py -k "test_forward_pair_stores_on_cuda or test_unknown_kernel_choice_is_an_error"
CS=/usr/local/cuda/bin/compute-sanitizer
# (case 2: head dim 256 causal with a window, a 33-row block; 17: value head dim 120 in a
# 128-column tile, so that a lane's 8 columns past the width are skipped)
for check in racecheck:2 racecheck:17 memcheck:2; do
  tool=${check%%:*} case=${check#*:}
  step ${tool}_$case 60 $CS --tool $tool --print-limit 4 python3 .ci/gpu/sanitize_cases.py --cases $case
  grep -E "SUMMARY" "$out/${tool}_$case.log"
done
(( $(left) > 100 )) && {
  benchmark_to hd256_table "$out/hd256_table.md" $(( $(left) - 10 )) --seqs 1024 2048 4096 8192 16384 --head-dims 256 --causal both
  echo "== hd256_table $(elapsed)"; grep -E "^\| [0-9]" "$out/hd256_table.md" | cut -c1-200; }
mkdir -p "$runs/logs" && mv "$out"/*.log "$runs/logs"/ 2>/dev/null
tar -C "$runs" -czf "$out/gpu_runs.tgz" .
echo "== done $(elapsed)"
# Call B (a call of its own, ~300 s): the decode file, -vv:
#   step decode 280 "${PT[@]}" -vv -n 6 -rf tests/test_cuda_decode.py
