#!/usr/bin/env bash
# Session 22 call 2: the split head-dim backward at head dim 256 (JAX_FLASH_CUDA_BACKWARD=
# sm90ws_split): its tests, sanitizer and speed against the default (mma.sync there) with cuDNN in
# each process; then the default suite's first half (the shared backward steps changed shape).
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -2 "$out/build.log"; echo "== build $(elapsed)"
export XLA_FLAGS=--xla_gpu_autotune_level=0
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short)
SPLIT=JAX_FLASH_CUDA_BACKWARD=sm90ws_split
env $SPLIT timeout 150 "${PT[@]}" -n 14 tests/test_cuda.py -k "(test_cuda_matches_reference or test_deterministic_matches_reference) and (h256 or h200)" >"$out/split_tests.log" 2>&1
tail -2 "$out/split_tests.log"; grep -E "^FAILED" "$out/split_tests.log" | head -10; echo "== split tests $(elapsed)"
env $SPLIT timeout 100 "${PT[@]}" -n 14 tests/test_softcap.py tests/test_alibi.py tests/test_segment_ids.py tests/test_cuda_block_sparse.py -k "cuda and h256" >>"$out/split_tests.log" 2>&1
tail -2 "$out/split_tests.log"; grep -E "^FAILED" "$out/split_tests.log" | sort -u | head -10; echo "== split general $(elapsed)"
{
  env $SPLIT timeout 100 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --target-processes all python3 .ci/gpu/sanitize_cases.py --cases 11,12 2>&1 | grep -E "^case|ERROR SUMMARY|Invalid|Error" | head -20
  env $SPLIT timeout 100 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --target-processes all python3 .ci/gpu/sanitize_cases.py --score-mods --segment-ids --cases 11 2>&1 | grep -E "^case|ERROR SUMMARY|Invalid|Error" | head -20
  env $SPLIT timeout 150 /usr/local/cuda/bin/compute-sanitizer --tool racecheck --target-processes all python3 .ci/gpu/sanitize_cases.py --cases 11 2>&1 | grep -E "^case|RACECHECK SUMMARY|ERROR SUMMARY|hazard" | head -20
} >"$out/sanitize.log" 2>&1
cat "$out/sanitize.log"; echo "== sanitize $(elapsed)"
unset XLA_FLAGS
{
  for choice in default sm90ws_split; do
    assignment=(); [[ $choice != default ]] && assignment=("JAX_FLASH_CUDA_BACKWARD=$choice")
    echo "### benchmark hd256, backward $choice (cuDNN in the same process)"
    env "${assignment[@]}" timeout 100 python3 -m jax_flash.benchmark --platform gpu --seqs 4096 8192 --head-dims 256 --reps 5 --skip xla pallas tokamax --out "$runs/bwd256_$choice" 2>"$runs/bwd256_${choice}_progress.log"
    echo "== backward $choice $(elapsed)"
  done
} 2>&1 | tee "$out/bench.log"
tar czf "$out/runs.tgz" "$runs"
export XLA_FLAGS=--xla_gpu_autotune_level=0
timeout 170 "${PT[@]}" -n 14 tests/test_cuda.py tests/test_cuda_decode.py tests/test_alibi.py tests/test_softcap.py tests/test_segment_ids.py tests/test_cuda_block_sparse.py tests/test_sinks.py -k "not differential and not on_hopper and not on_cuda" >"$out/default_tests.log" 2>&1
tail -2 "$out/default_tests.log"; grep -E "^FAILED" "$out/default_tests.log" | head -10; echo "== default tests $(elapsed)"
