#!/usr/bin/env bash
# Session 22 call 6 (the last of the device time): the Hopper backward's head splits (MQA/GQA
# with few CTAs: gpu/launch.h kv_head_splits): test_cuda.py's reference and deterministic cases
# and the workspace test, then MQA 16/1 beside cuDNN and tokamax.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
source .ci/gpu/tokamax_peer.sh >/dev/null 2>&1
head -1 "$out/build.log"; echo "== build $(elapsed)"
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -n 14 tests/test_cuda.py -k "test_cuda_matches_reference or test_deterministic_matches_reference or workspace_holds" >"$out/tests.log" 2>&1
tail -2 "$out/tests.log"; grep -E "^FAILED" "$out/tests.log" | head -10; echo "== tests $(elapsed)"
timeout 60 python3 -m jax_flash.benchmark --platform gpu --seqs 4096 --head-dims 128 --heads 16 --kv-heads 1 --causal yes --reps 5 --skip xla pallas --out "$runs/mqa" 2>"$runs/mqa_progress.log" | tee "$out/bench.log"
echo "== mqa $(elapsed)"
tar czf "$out/runs.tgz" "$runs"
