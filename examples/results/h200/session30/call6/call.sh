#!/usr/bin/env bash
# Session 30 call 6 (the final tree's kernels; call 5's modules): the kernel-choice test call 4's
# limit cut, JAX_FLASH_CUDA_HD192_BWD=padded's selection with its subprocesses, alone.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -1 "$out/build.log"
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 220 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short \
  tests/test_cuda.py -k "test_head_dims_to_192_backward_off_their_own_kernels_on_hopper and padded" >"$out/tests.log" 2>&1
echo "tests: $(tail -1 "$out/tests.log") $(elapsed)"; grep -E "^FAILED|^E " "$out/tests.log" | head -10
