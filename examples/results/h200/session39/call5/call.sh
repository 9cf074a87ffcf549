#!/usr/bin/env bash
# Session 39, call 5: a racecheck of an arrays case (bias and mask arrays, the Hopper kernels under
# JAX_FLASH_CUDA_LOGIT_ARRAYS=on), which call 3's 50 s did not finish; case 5: B1 T200 S150
# N2/1 H64 causal with a (1, N, T, S) bias.
#   run from the repository root on the GPU machine: bash examples/results/h200/session39/call5/call.sh
set -uo pipefail
source .ci/gpu/call_preamble.sh  # (step, bench)
step racecheck_arrays_5 $(( $(left) - 20 )) /usr/local/cuda/bin/compute-sanitizer --tool racecheck --print-limit 4 \
  python3 .ci/gpu/sanitize_cases.py --logit-arrays --cases 5
grep -E "^case|SUMMARY|hazard" "$out/racecheck_arrays_5.log" | head -8
echo "== done $(elapsed)"
