#!/usr/bin/env bash
# Session 26 call 2: dQ's atomics deferred to the next visit's first products (head dim 256's
# second 64-column block; head dim 64's 128-row visits: the warpgroup's rows), so that they run
# beside the tensor cores. The benchmark (bwd beside cuDNN, hd 64 and 256) for three builds,
# each in its own process: the committed build before the quad order (build/baseline, f9dea3c),
# the quad order alone (build/variant_b, a076682) and this tree; the GPU tests and memcheck on
# cases 11 and 5 for this tree.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
echo "== build $(elapsed)"
for b in baseline variant_b; do
  rm -rf /tmp/$b; mkdir -p /tmp/$b; cp -r jax_flash /tmp/$b/
  xz -dc build/$b/_native_cuda.so.xz >/tmp/$b/jax_flash/_native_cuda.cpython-312-x86_64-linux-gnu.so
  cp build/$b/_native.cpython-312-x86_64-linux-gnu.so /tmp/$b/jax_flash/
done
B=(python3 -m jax_flash.benchmark --platform gpu --reps 5 --seqs 4096 8192 --head-dims 64 256 --causal both --skip xla pallas tokamax)
{
  for b in baseline variant_b; do
    echo "### $b"
    (cd /tmp/$b && PYTHONPATH=/tmp/$b timeout -s KILL 120 "${B[@]}" --out "$OLDPWD/$runs/$b" 2>"$OLDPWD/$runs/${b}_progress.log")
    echo "== $b $(elapsed)"
  done
  echo "### this tree"
  timeout -s KILL 120 "${B[@]}" --out "$runs/new" 2>"$runs/new_progress.log"
  echo "== new $(elapsed)"
} 2>&1 | grep -v "unavailable: skipped" >"$out/bench.log"
grep -E "###|==|bwd \|" "$out/bench.log" | cut -c1-100
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short)
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 200 "${PT[@]}" -n 14 tests/test_cuda.py tests/test_cuda_ffi_validation.py \
  tests/test_alibi.py tests/test_softcap.py tests/test_segment_ids.py tests/test_cuda_block_sparse.py tests/test_sinks.py \
  -k "not differential and not on_hopper and not on_cuda" >"$out/tests.log" 2>&1
tail -1 "$out/tests.log"; grep -E "^FAILED|^ERROR" "$out/tests.log" | head -20; echo "== tests $(elapsed)"
CS=/usr/local/cuda/bin/compute-sanitizer
for c in 11 5; do
  timeout -s KILL 60 $CS --tool memcheck --print-limit 4 python3 .ci/gpu/sanitize_cases.py --cases $c >"$runs/memcheck_$c.log" 2>&1
  echo "case $c: $(grep -E "SUMMARY" "$runs/memcheck_$c.log")"
done | tee "$out/memcheck.log"
timeout -s KILL 60 $CS --tool racecheck --print-limit 4 python3 .ci/gpu/sanitize_cases.py --cases 11 >"$runs/racecheck_11.log" 2>&1
echo "racecheck case 11: $(grep -E "SUMMARY" "$runs/racecheck_11.log")" | tee "$out/racecheck.log"
tar czf "$out/runs.tgz" "$runs"
echo "== done $(elapsed)"
