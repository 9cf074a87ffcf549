#!/usr/bin/env bash
# Session 41, call 2: call 1's suite finished 8 tests in 200 s (-n 14) and was killed: find what
# hangs. The CUDA suite's main files, verbose, with pytest's faulthandler dumping the stacks of a
# test past 30 s; first the reference cases alone on 8 workers.
#   run from the repository root on the GPU machine: bash examples/results/h200/session41/call2/call.sh
set -uo pipefail
BUDGET_S=300 source .ci/gpu/call_preamble.sh  # (step, bench)
step reference 120 "${PT[@]}" -n 8 -v -o faulthandler_timeout=30 tests/test_cuda.py -k "test_cuda_matches_reference and h64"
grep -E "PASSED|FAILED|Timeout|File .*test_" "$out/reference.log" | head -40 | cut -c1-160
step suite 130 "${PT[@]}" -n 14 -v -o faulthandler_timeout=30 tests/test_cuda.py tests/test_cuda_ffi_validation.py \
  tests/test_value_head_dim.py -k "not differential and not on_hopper and not on_cuda and not more_tiles"
grep -cE "PASSED" "$out/suite.log"; grep -E "FAILED|Timeout" "$out/suite.log" | head -20 | cut -c1-160
echo "== done $(elapsed)"
