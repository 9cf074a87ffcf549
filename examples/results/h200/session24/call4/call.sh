#!/usr/bin/env bash
# Session 24 call 4: the build to commit. Call 2's uniform warpgroup index, now only in the plain
# kernels of 64-row visits in the backward (head dim 64's 128-row kernel as committed: call 3
# measured it 2-3% slower with it), and the backward's rows' lse and delta read as float2 (one
# 8-byte shared load a query pair instead of two). The GPU suite's CUDA files as in call 2;
# racecheck cases 13 and 6; heads dims 64 and 128 at seq 4096 and 8192 beside cuDNN for the
# committed build's modules (build/baseline) and this tree's, each in its own process; MQA 16/1
# and GQA 32/8 at seq 4096 causal beside cuDNN and tokamax on this tree; then the full table
# (head dims 64, 128, 256; seq 1024 to 16384; causal and not) beside cuDNN and tokamax, as far as
# the call's time goes (the benchmark rewrites its results after each case).
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
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 220 "${PT[@]}" -n 14 tests/test_cuda.py tests/test_cuda_decode.py tests/test_cuda_ffi_validation.py \
  tests/test_alibi.py tests/test_softcap.py tests/test_segment_ids.py tests/test_cuda_block_sparse.py tests/test_sinks.py \
  -k "not differential and not on_hopper and not on_cuda" >"$out/tests.log" 2>&1
tail -2 "$out/tests.log"; grep -E "^FAILED|^ERROR" "$out/tests.log" | head -20; echo "== tests $(elapsed)"
RC=(/usr/local/cuda/bin/compute-sanitizer --tool racecheck --target-processes all --print-limit 4 python3 .ci/gpu/sanitize_cases.py --cases)
for c in 13 6; do echo "### racecheck case $c"; timeout 50 "${RC[@]}" $c 2>&1 | cut -c1-300 | head -30; done >"$out/racecheck.log" 2>&1
grep -E "^###|SUMMARY" "$out/racecheck.log"; echo "== racecheck $(elapsed)"
B=(python3 -m jax_flash.benchmark --platform gpu --reps 5 --causal both --skip xla pallas tokamax)
{
  echo "### baseline (committed modules)"
  (cd $base && PYTHONPATH=$base timeout 120 "${B[@]}" --seqs 4096 8192 --head-dims 64 128 --out "$OLDPWD/$runs/base" 2>"$OLDPWD/$runs/base_progress.log")
  echo "== base $(elapsed)"
  echo "### this tree"
  timeout 120 "${B[@]}" --seqs 4096 8192 --head-dims 64 128 --out "$runs/new" 2>"$runs/new_progress.log"
  echo "== new $(elapsed)"
} 2>&1 | grep -v "unavailable: skipped" | tee "$out/bench.log"
source .ci/gpu/tokamax_peer.sh
G=(python3 -m jax_flash.benchmark --platform gpu --reps 5 --causal yes --seqs 4096 --head-dims 128 --skip xla pallas)
{
  echo "### MQA 16/1"; timeout 60 "${G[@]}" --heads 16 --kv-heads 1 --out "$runs/mqa" 2>"$runs/mqa_progress.log"
  echo "== mqa $(elapsed)"
  echo "### GQA 32/8"; timeout 60 "${G[@]}" --heads 32 --kv-heads 8 --out "$runs/gqa" 2>"$runs/gqa_progress.log"
  echo "== gqa $(elapsed)"
} 2>&1 | grep -v "unavailable: skipped\|grouped-query" | tee -a "$out/bench.log"
echo "### full table" | tee -a "$out/bench.log"
timeout $(( 570 - ($(date +%s) - start) )) python3 -m jax_flash.benchmark --platform gpu --reps 5 --causal both \
  --seqs 1024 2048 4096 8192 16384 --head-dims 128 64 256 --skip xla pallas --out "$runs/full" 2>"$runs/full_progress.log" >/dev/null
cat "$runs/full/table.md" >>"$out/bench.log"; echo "== full $(elapsed)"
tar czf "$out/runs.tgz" "$runs"
echo "== done $(elapsed)"
