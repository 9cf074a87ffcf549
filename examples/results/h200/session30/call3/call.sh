#!/usr/bin/env bash
# Session 30 call 3 (call 2 again after its mends: dK of the pair's warpgroup 1 stored in 64-column pieces,
# whose XOR-moved stores had overwritten warpgroup 0's columns; the FFI test's message). The backward of
# value head dim 192 / 128 on a split kernel of its own
# (the default with the forward's pair kernels): the value head dim's GPU tests (the padded path
# in a subprocess), the CUDA suite's files without their subprocess runs, memcheck on the two
# new sanitizer cases and racecheck on both; issue 17's 192 / 128 figure with tokamax, this
# tree's default and JAX_FLASH_CUDA_VALUE_HEAD_DIM=padded.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -1 "$out/build.log"
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rs)
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 240 "${PT[@]}" -n 8 tests/test_value_head_dim.py >"$out/value_tests.log" 2>&1
echo "value head dim tests: $(tail -1 "$out/value_tests.log") $(elapsed)"; grep -E "^FAILED|^ERROR|^E " "$out/value_tests.log" | head -20
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 170 "${PT[@]}" -n 14 tests/test_cuda.py tests/test_cuda_ffi_validation.py \
  tests/test_alibi.py tests/test_softcap.py tests/test_segment_ids.py tests/test_cuda_block_sparse.py tests/test_sinks.py \
  -k "not differential and not on_hopper and not on_cuda" >"$out/tests.log" 2>&1
echo "tests: $(tail -1 "$out/tests.log") $(elapsed)"; grep -E "^FAILED|^ERROR" "$out/tests.log" | head -20
for c in 16 17; do
  timeout -s KILL 80 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --print-limit 4 \
    python3 .ci/gpu/sanitize_cases.py --cases $c >"$runs/memcheck_$c.log" 2>&1
  echo "memcheck case $c: $(grep -E "^case|SUMMARY" "$runs/memcheck_$c.log" | tr '\n' ' ') $(elapsed)"
done
for c in 16 17; do
  timeout -s KILL 100 /usr/local/cuda/bin/compute-sanitizer --tool racecheck --print-limit 4 \
    python3 .ci/gpu/sanitize_cases.py --cases $c >"$runs/racecheck_$c.log" 2>&1
  echo "racecheck case $c: $(grep -E "^case|SUMMARY" "$runs/racecheck_$c.log" | tr '\n' ' ') $(elapsed)"
done
source .ci/gpu/tokamax_peer.sh
B=(python3 -m jax_flash.benchmark --platform gpu --reps 5 --seqs 4096 8192 --head-dims 192 --value-head-dim 128
   --causal both --skip xla pallas)
for mode in native padded; do
  env=()
  [[ $mode == padded ]] && env=(JAX_FLASH_CUDA_VALUE_HEAD_DIM=padded)
  env "${env[@]}" timeout -s KILL 100 "${B[@]}" --out "$runs/$mode" 2>"$runs/${mode}_progress.log" >"$out/value_head_dim_$mode.md"
  echo "== $mode $(elapsed)"; grep -E "^\| [0-9]" "$out/value_head_dim_$mode.md" | cut -d'|' -f2-12
done
tar czf "$out/runs.tgz" "$runs"
echo "== done $(elapsed)"
