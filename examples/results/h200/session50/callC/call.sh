#!/usr/bin/env bash
# Session 50, call C (run right after call B on the same warm H100, 382 s): the GPU tests beyond
# test_cuda.py's main selection, of the tree call B ran (main 708775a + the skip in the 192-row
# kernels only), every `-m gpu` file but tests/test_cuda_decode.py, at -n 14. It was sent as one
# command line:
export BUDGET_S=420; set -uo pipefail; source .ci/gpu/call_preamble.sh
step gpu_tests 380 "${PT[@]}" -n 14 tests/ --ignore=tests/test_cuda_decode.py
tail -5 $out/gpu_tests.log
