#!/usr/bin/env bash
# Session 25 call 5: the default forward takes the tile counter without a causal mask and the
# static pairs with one (call 4's measurement); the static and dynamic grids' own test runs
# (JAX_FLASH_CUDA_FORWARD=sm90ws_static / sm90ws_dynamic: each grid on every mask); the default's
# forward beside cuDNN at head dims 64 and 128.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -2 "$out/build.log"; echo "== build $(elapsed)"
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 200 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -n 2 \
  tests/test_cuda.py -k "static_persistent or dynamic_persistent" >"$out/tests_grids.log" 2>&1
tail -2 "$out/tests_grids.log"; grep -E "^FAILED|^ERROR" "$out/tests_grids.log" | head; echo "== grid tests $(elapsed)"
timeout -s KILL 60 python3 .ci/gpu/forward_variants.py --reps 10 --variants default --head-dims 64 128 \
  --seqs 2048 4096 --out "$runs/default" >"$out/variants.log" 2>"$runs/default_progress.log"
cat "$out/variants.log"; echo "== variants $(elapsed)"
tar czf "$out/runs.tgz" "$runs"
echo "== done $(elapsed)"
