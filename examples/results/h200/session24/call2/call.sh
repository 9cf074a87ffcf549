#!/usr/bin/env bash
# Session 24 call 2: the consumer warpgroup's index broadcast from lane 0 (__shfl_sync) in the
# Hopper forward and backward, so that ptxas keeps the wgmma descriptors derived from it in
# uniform registers (hd128 backward visit: 929 -> 729 SASS instructions). The GPU suite's CUDA
# files (test_cuda.py without its kernel-choice subprocess runs; the score variants', segment
# ids', block-sparse, sinks' and decode files); racecheck on case 13; hd128 seq 4096 and 8192
# beside cuDNN for the committed build's modules (build/baseline) and this tree's, each in its
# own process.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -2 "$out/build.log"; echo "== build $(elapsed)"
base=/tmp/base; rm -rf $base; mkdir -p $base; cp -r jax_flash $base/
xz -dc build/baseline/_native_cuda.so.xz >$base/jax_flash/_native_cuda.cpython-312-x86_64-linux-gnu.so
cp build/baseline/_native.cpython-312-x86_64-linux-gnu.so $base/jax_flash/
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short)
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 250 "${PT[@]}" -n 14 tests/test_cuda.py tests/test_cuda_decode.py tests/test_cuda_ffi_validation.py \
  tests/test_alibi.py tests/test_softcap.py tests/test_segment_ids.py tests/test_cuda_block_sparse.py tests/test_sinks.py \
  -k "not differential and not on_hopper and not on_cuda" >"$out/tests.log" 2>&1
tail -2 "$out/tests.log"; grep -E "^FAILED|^ERROR" "$out/tests.log" | head -20; echo "== tests $(elapsed)"
RC=(/usr/local/cuda/bin/compute-sanitizer --tool racecheck --target-processes all --print-limit 4 python3 .ci/gpu/sanitize_cases.py --cases)
timeout 60 "${RC[@]}" 13 2>&1 | cut -c1-300 | head -30 >"$out/racecheck.log"
grep -E "SUMMARY" "$out/racecheck.log"; echo "== racecheck $(elapsed)"
B=(python3 -m jax_flash.benchmark --platform gpu --reps 5 --seqs 4096 8192 --head-dims 128 --causal both --skip xla pallas tokamax)
{
  echo "### baseline (committed modules)"
  (cd $base && PYTHONPATH=$base timeout 110 "${B[@]}" --out "$OLDPWD/$runs/base" 2>"$OLDPWD/$runs/base_progress.log")
  echo "== base $(elapsed)"
  echo "### this tree"
  timeout 110 "${B[@]}" --out "$runs/new" 2>"$runs/new_progress.log"
  echo "== new $(elapsed)"
} 2>&1 | grep -v "unavailable: skipped" | tee "$out/bench.log"
tar czf "$out/runs.tgz" "$runs"
echo "== done $(elapsed)"
