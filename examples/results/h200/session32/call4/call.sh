#!/usr/bin/env bash
# Session 32, call 4: after the dropout changes (new bit layout, the mma.sync kernels' dropout
# instantiations, deterministic dropout on the mma.sync backward), the CUDA suite's main files
# and the dropout file (its subprocess runs with the switch on, as chosen and all on sm80), then
# the decode kernel's reference tests under evict_first (call 3's decode run was killed at 150 s).
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -1 "$out/build.log"
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rs)
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 200 "${PT[@]}" -n 14 tests/test_cuda.py tests/test_cuda_ffi_validation.py \
  tests/test_dropout.py tests/test_dropout_bits.py -k "not differential and not on_hopper and not on_cuda" >"$out/tests.log" 2>&1
echo "tests: $(tail -1 "$out/tests.log") $(elapsed)"; grep -E "^FAILED|^ERROR" "$out/tests.log" | head -20
JAX_FLASH_CUDA_DECODE_LOADS=evict_first XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 120 "${PT[@]}" -n 8 \
  tests/test_cuda_decode.py -k "contiguous_matches or paged_matches" >"$out/decode_tests.log" 2>&1
echo "decode tests under evict_first: $(tail -1 "$out/decode_tests.log") $(elapsed)"; grep -E "^FAILED|^E " "$out/decode_tests.log" | head -8
echo "== done $(elapsed)"
