#!/usr/bin/env bash
# Session 24 call 1: every consumer thread releases the backward's stage (racecheck's lse/delta
# hazards of session 23), and the deferred-dQ backward with its warpgroups' score products kept
# apart (sm90ws_skew: once at the start; sm90ws_pingpong: every visit). test_cuda.py without its
# kernel-choice subprocess runs but the deferred families'; racecheck on cases 13 and 3 (default)
# and 6 and 10 (sm90ws_pingpong); hd128 seq 4096 bwd beside cuDNN: the committed build's modules
# (build/baseline, 2d2a7b8's stamp), this tree's default, sm90ws_pingpong, sm90ws_skew and
# sm90ws_deferdq, each in its own process.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -2 "$out/build.log"; echo "== build $(elapsed)"
# The committed build's modules beside the same Python package.
base=/tmp/base; rm -rf $base; mkdir -p $base; cp -r jax_flash $base/
xz -dc build/baseline/_native_cuda.so.xz >$base/jax_flash/_native_cuda.cpython-312-x86_64-linux-gnu.so
cp build/baseline/_native.cpython-312-x86_64-linux-gnu.so $base/jax_flash/
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short)
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 200 "${PT[@]}" -n 14 tests/test_cuda.py \
  -k "not on_hopper and not on_cuda or test_backward_with_deferred_dq_on_hopper" >"$out/tests.log" 2>&1
tail -2 "$out/tests.log"; grep -E "^FAILED|^ERROR" "$out/tests.log" | head -20; echo "== tests $(elapsed)"
RC=(/usr/local/cuda/bin/compute-sanitizer --tool racecheck --target-processes all --print-limit 4 python3 .ci/gpu/sanitize_cases.py --cases)
for run in "13 sm90ws" "3 sm90ws" "6 sm90ws_pingpong" "10 sm90ws_pingpong"; do
  set -- $run
  echo "### racecheck case $1, JAX_FLASH_CUDA_BACKWARD=$2"
  env JAX_FLASH_CUDA_BACKWARD=$2 timeout 60 "${RC[@]}" "$1" 2>&1 | cut -c1-300 | head -30
  echo "== racecheck $1 $2 $(elapsed)"
done >"$out/racecheck.log" 2>&1
grep -E "^###|SUMMARY|^==" "$out/racecheck.log"
B=(python3 -m jax_flash.benchmark --platform gpu --reps 5 --seqs 4096 --head-dims 128 --causal both --skip xla pallas tokamax)
{
  echo "### baseline (committed modules)"
  (cd $base && PYTHONPATH=$base timeout 80 "${B[@]}" --out "$OLDPWD/$runs/base" 2>"$OLDPWD/$runs/base_progress.log")
  echo "== base $(elapsed)"
  for fam in sm90ws sm90ws_pingpong sm90ws_skew sm90ws_deferdq; do
    echo "### $fam"
    JAX_FLASH_CUDA_BACKWARD=$fam timeout 80 "${B[@]}" --out "$runs/$fam" 2>"$runs/${fam}_progress.log"
    echo "== $fam $(elapsed)"
  done
} 2>&1 | grep -v "unavailable: skipped" | tee "$out/bench.log"
tar czf "$out/runs.tgz" "$runs"
echo "== done $(elapsed)"
