#!/usr/bin/env bash
# Session 22 call 1: sm90ws_m80 with dK issued first (8217f36): tests, sanitizer, and the backward
# A/B against the default (cuDNN in each process); the cap's units refactor (c7f85c5): the score
# variants' CUDA tests and memcheck.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
source .ci/gpu/tokamax_peer.sh
head -3 "$out/build.log"; echo "== build $(elapsed)"
export XLA_FLAGS=--xla_gpu_autotune_level=0
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short)
M80_SEL="((test_cuda_matches_reference or test_deterministic_matches_reference) and h128) or test_command_buffer_capture or test_jit_training_step_reduces_loss"
JAX_FLASH_CUDA_BACKWARD=sm90ws_m80 timeout 150 "${PT[@]}" -n 14 tests/test_cuda.py -k "$M80_SEL" >"$out/m80_tests.log" 2>&1
tail -2 "$out/m80_tests.log"; grep -E "^FAILED" "$out/m80_tests.log" | head -10; echo "== m80 tests $(elapsed)"
timeout 120 "${PT[@]}" -n 14 tests/test_softcap.py tests/test_alibi.py tests/test_segment_ids.py -k "cuda" >"$out/general.log" 2>&1
tail -2 "$out/general.log"; grep -E "^FAILED" "$out/general.log" | head -10; echo "== score variants (default) $(elapsed)"
{
  JAX_FLASH_CUDA_BACKWARD=sm90ws_m80 timeout 100 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --target-processes all python3 .ci/gpu/sanitize_cases.py --cases 6,10 2>&1 | grep -E "^case|ERROR SUMMARY|Invalid|Error" | head -20
  JAX_FLASH_CUDA_BACKWARD=sm90ws_m80 timeout 150 /usr/local/cuda/bin/compute-sanitizer --tool racecheck --target-processes all python3 .ci/gpu/sanitize_cases.py --cases 10 2>&1 | grep -E "^case|RACECHECK SUMMARY|ERROR SUMMARY|hazard" | head -20
  timeout 100 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --target-processes all python3 .ci/gpu/sanitize_cases.py --score-mods --cases 0,6 2>&1 | grep -E "^case|ERROR SUMMARY|Invalid|Error" | head -20
} >"$out/sanitize.log" 2>&1
cat "$out/sanitize.log"; echo "== sanitize $(elapsed)"
unset XLA_FLAGS
{
  for choice in default sm90ws_m80; do
    assignment=(); [[ $choice != default ]] && assignment=("JAX_FLASH_CUDA_BACKWARD=$choice")
    echo "### benchmark, backward $choice (cuDNN in the same process)"
    env "${assignment[@]}" timeout 110 python3 -m jax_flash.benchmark --platform gpu --seqs 4096 8192 --head-dims 128 --reps 5 --skip xla pallas tokamax --out "$runs/bwd_$choice" 2>"$runs/bwd_${choice}_progress.log"
    echo "== backward $choice $(elapsed)"
  done
} 2>&1 | tee "$out/bench.log"
tar czf "$out/runs.tgz" "$runs"
