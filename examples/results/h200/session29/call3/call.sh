#!/usr/bin/env bash
# Session 29 call 3 (this tree: the backward's producer issues a stage's TMA before it loads the
# rows' lse and delta; JAX_FLASH_CUDA_HD192_BWD=native3, head dim 192's split kernel with three
# stages, experimental). The native3 selection directly under the variable; memcheck under native3 on sanitizer case 14 (a
# plain non-deterministic call at head dim 176); then the backward at head dims 128, 192 and 256 (seq 4096 and
# 8192, cuDNN in each process) for the committed modules (build/baseline: f5233d8's) and this
# tree's, each in its own process, and this tree's under native3 at 192.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -1 "$out/build.log"
base=/tmp/base; rm -rf $base; mkdir -p $base; cp -r jax_flash $base/
xz -dc build/baseline/_native_cuda.so.xz >$base/jax_flash/_native_cuda.cpython-312-x86_64-linux-gnu.so
cp build/baseline/_native.cpython-312-x86_64-linux-gnu.so $base/jax_flash/
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short)
REF="(test_cuda_matches_reference or test_deterministic_matches_reference)"
JAX_FLASH_CUDA_HD192_BWD=native3 XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 90 "${PT[@]}" -n 8 tests/test_cuda.py \
  -k "($REF and (h136 or h160 or h192)) or test_command_buffer_capture or test_jit_training_step_reduces_loss" \
  >"$runs/native3.log" 2>&1
echo "native3: $(tail -1 "$runs/native3.log") $(elapsed)"; grep -E "^FAILED|^E " "$runs/native3.log" | head -5
JAX_FLASH_CUDA_HD192_BWD=native3 timeout -s KILL 80 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --print-limit 4 \
  python3 .ci/gpu/sanitize_cases.py --cases 14 >"$runs/memcheck_native3_14.log" 2>&1
echo "memcheck native3 case 14: $(grep -E "SUMMARY" "$runs/memcheck_native3_14.log") $(elapsed)"
B=(python3 -m jax_flash.benchmark --platform gpu --reps 5 --seqs 4096 8192 --head-dims 128 192 256 --causal both
   --skip xla pallas tokamax)
{
  echo "### baseline (f5233d8's modules)"
  (cd $base && PYTHONPATH=$base timeout -s KILL 150 "${B[@]}" --out "$OLDPWD/$runs/base" 2>"$OLDPWD/$runs/base_progress.log")
  echo "== base $(elapsed)"
  echo "### this tree"
  timeout -s KILL 150 "${B[@]}" --out "$runs/new" 2>"$runs/new_progress.log"
  echo "== new $(elapsed)"
  echo "### this tree, JAX_FLASH_CUDA_HD192_BWD=native3"
  JAX_FLASH_CUDA_HD192_BWD=native3 timeout -s KILL 80 python3 -m jax_flash.benchmark --platform gpu --reps 5 --seqs 4096 8192 \
    --head-dims 192 --causal both --skip xla pallas tokamax --out "$runs/native3" 2>"$runs/native3_progress.log"
  echo "== native3 $(elapsed)"
} 2>&1 | grep -v "unavailable: skipped" | grep -E "^#|^==|^\| [0-9]" | grep -v "| fwd |" | tee "$out/bench.log"
tar czf "$out/runs.tgz" "$runs"
echo "== done $(elapsed)"
