#!/usr/bin/env bash
# Session 24 call 3 (the tree of call 2): end to end, examples/train_lm.py's GPT-2-small shape
# against cuDNN at seq 1024 (batch 16) and seq 4096 (batch 4); then head dims 64 and 256 at seq
# 4096 beside cuDNN for the committed build's modules (build/baseline) and this tree's, each in
# its own process.
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
timeout 130 python3 examples/train_lm.py --preset gpt2-small --compare jax_flash,cudnn --steps 200 --out "$runs/e2e1024" >"$out/e2e1024.log" 2>&1
grep -A4 "^| attention" "$out/e2e1024.log"; echo "== e2e 1024 $(elapsed)"
timeout 130 python3 examples/train_lm.py --preset gpt2-small --compare jax_flash,cudnn --seq-len 4096 --batch-size 4 --steps 100 --out "$runs/e2e4096" >"$out/e2e4096.log" 2>&1
grep -A4 "^| attention" "$out/e2e4096.log"; echo "== e2e 4096 $(elapsed)"
B=(python3 -m jax_flash.benchmark --platform gpu --reps 5 --seqs 4096 --head-dims 64 256 --causal both --skip xla pallas tokamax)
{
  echo "### baseline (committed modules)"
  (cd $base && PYTHONPATH=$base timeout 100 "${B[@]}" --out "$OLDPWD/$runs/base" 2>"$OLDPWD/$runs/base_progress.log")
  echo "== base $(elapsed)"
  echo "### this tree"
  timeout 100 "${B[@]}" --out "$runs/new" 2>"$runs/new_progress.log"
  echo "== new $(elapsed)"
} 2>&1 | grep -v "unavailable: skipped" | tee "$out/bench.log"
tar czf "$out/runs.tgz" --exclude="*.png" --exclude="*.npz" --exclude="*checkpoint*" "$runs"
echo "== done $(elapsed)"
