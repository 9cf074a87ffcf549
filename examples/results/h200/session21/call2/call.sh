#!/usr/bin/env bash
# Session 21 call 1: the m80 backward's tests and sanitizer, then the default's general and
# forward-only tests (cap units, TMA-store forward default).
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -3 "$out/build.log"; echo "== build $(elapsed)"
export XLA_FLAGS=--xla_gpu_autotune_level=0
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short)
M80_SEL="((test_cuda_matches_reference or test_deterministic_matches_reference) and h128) or test_command_buffer_capture or test_jit_training_step_reduces_loss"
JAX_FLASH_CUDA_BACKWARD=sm90ws_m80 timeout 200 "${PT[@]}" -n 14 tests/test_cuda.py -k "$M80_SEL" >"$out/m80_tests.log" 2>&1
tail -4 "$out/m80_tests.log"; grep -E "^FAILED" "$out/m80_tests.log" | head -10; echo "== m80 tests $(elapsed)"
JAX_FLASH_CUDA_BACKWARD=sm90ws_m80 timeout 120 "${PT[@]}" -n 14 tests/test_softcap.py tests/test_alibi.py tests/test_segment_ids.py -k "cuda and h128" >"$out/m80_general.log" 2>&1
tail -2 "$out/m80_general.log"; echo "== m80 general $(elapsed)"
{
  JAX_FLASH_CUDA_BACKWARD=sm90ws_m80 XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 150 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --target-processes all python3 .ci/gpu/sanitize_cases.py --cases 6,10 2>&1 | grep -E "^case|ERROR SUMMARY|Invalid|Error" | head -20
  JAX_FLASH_CUDA_BACKWARD=sm90ws_m80 XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 200 /usr/local/cuda/bin/compute-sanitizer --tool racecheck --target-processes all python3 .ci/gpu/sanitize_cases.py --cases 10 2>&1 | grep -E "^case|RACECHECK SUMMARY|ERROR SUMMARY|hazard" | head -20
  XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 150 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --target-processes all python3 .ci/gpu/sanitize_cases.py --score-mods --cases 0,1,6 2>&1 | grep -E "^case|ERROR SUMMARY|Invalid|Error" | head -20
} >"$out/sanitize.log" 2>&1
cat "$out/sanitize.log"; echo "== sanitize $(elapsed)"
timeout 240 "${PT[@]}" -n 14 tests/test_cuda.py tests/test_cuda_decode.py tests/test_alibi.py tests/test_softcap.py tests/test_segment_ids.py tests/test_cuda_block_sparse.py tests/test_sinks.py -k "not differential and not on_hopper and not on_cuda" >"$out/default_tests.log" 2>&1
tail -4 "$out/default_tests.log"; grep -E "^FAILED" "$out/default_tests.log" | head -10; echo "== default tests $(elapsed)"
