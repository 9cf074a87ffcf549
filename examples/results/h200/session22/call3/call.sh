#!/usr/bin/env bash
# Session 22 call 3: the split head-dim backward the default at head dim 256 (dQ's first block
# issued beside dK and dV), add_dq's column fixed for 128-row visits: the default suite's first
# half, the sanitizer, mma.sync's selection at 256, then head dim 256 against mma.sync with cuDNN
# (and tokamax in the default's process).
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
source .ci/gpu/tokamax_peer.sh
head -2 "$out/build.log"; echo "== build $(elapsed)"
export XLA_FLAGS=--xla_gpu_autotune_level=0
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short)
timeout 200 "${PT[@]}" -n 14 tests/test_cuda.py tests/test_cuda_decode.py tests/test_alibi.py tests/test_softcap.py tests/test_segment_ids.py tests/test_cuda_block_sparse.py tests/test_sinks.py -k "not differential and not on_hopper and not on_cuda" >"$out/default_tests.log" 2>&1
tail -2 "$out/default_tests.log"; grep -E "^FAILED" "$out/default_tests.log" | head -10; echo "== default tests $(elapsed)"
R="test_cuda_matches_reference"; D="test_deterministic_matches_reference"
JAX_FLASH_CUDA_FORWARD=sm80 JAX_FLASH_CUDA_BACKWARD=sm80 timeout 90 "${PT[@]}" -n 14 tests/test_cuda.py -k "($R or $D) and (h256 or h200)" >"$out/sm80_tests.log" 2>&1
tail -2 "$out/sm80_tests.log"; grep -E "^FAILED" "$out/sm80_tests.log" | head -10; echo "== sm80 h256 $(elapsed)"
{
  timeout 100 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --target-processes all python3 .ci/gpu/sanitize_cases.py --cases 11,12 2>&1 | grep -E "^case|ERROR SUMMARY|Invalid|Error" | head -20
  timeout 120 /usr/local/cuda/bin/compute-sanitizer --tool racecheck --target-processes all python3 .ci/gpu/sanitize_cases.py --cases 11 2>&1 | grep -E "^case|RACECHECK SUMMARY|ERROR SUMMARY|hazard" | head -20
} >"$out/sanitize.log" 2>&1
cat "$out/sanitize.log"; echo "== sanitize $(elapsed)"
unset XLA_FLAGS
{
  for choice in default sm80; do
    skip="xla pallas"; assignment=()
    [[ $choice != default ]] && { skip="xla pallas tokamax"; assignment=("JAX_FLASH_CUDA_BACKWARD=$choice"); }
    echo "### benchmark hd256, backward $choice"
    env "${assignment[@]}" timeout 110 python3 -m jax_flash.benchmark --platform gpu --seqs 4096 8192 --head-dims 256 --reps 5 --skip $skip --out "$runs/bwd256_$choice" 2>"$runs/bwd256_${choice}_progress.log"
    echo "== backward $choice $(elapsed)"
  done
} 2>&1 | tee "$out/bench.log"
tar czf "$out/runs.tgz" "$runs"
