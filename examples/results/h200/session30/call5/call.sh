#!/usr/bin/env bash
# Session 30 call 5 (after the review's mends: the kernels' SASS identical to call 3's, the host's
# pair lists rewritten). The value head dim's GPU tests with their subprocess runs, the FFI
# validation file, and the misspelt-switch test of JAX_FLASH_CUDA_VALUE_HEAD_DIM.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -1 "$out/build.log"
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rs)
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 200 "${PT[@]}" -n 10 tests/test_value_head_dim.py \
  tests/test_cuda_ffi_validation.py tests/test_cuda.py -k "not test_cuda.py or VALUE_HEAD_DIM" >"$out/tests.log" 2>&1
echo "tests: $(tail -1 "$out/tests.log") $(elapsed)"; grep -E "^FAILED|^ERROR|^E " "$out/tests.log" | head -20
echo "== done $(elapsed)"
