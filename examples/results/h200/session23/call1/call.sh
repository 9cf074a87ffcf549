#!/usr/bin/env bash
# Session 23 call 1: the causal backward's CTAs longest key blocks first (JAX_FLASH_CUDA_ORDER,
# default longest) against the grid's order: test_cuda.py (its kernel-choice subprocess runs
# left out but the grid order's), then causal fwd+bwd at hd128 MHA, GQA 32/8 and MQA 16/1, each
# order in its own process with cuDNN (and tokamax) beside it.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
source .ci/gpu/tokamax_peer.sh
head -2 "$out/build.log"; echo "== build $(elapsed)"
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short)
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 200 "${PT[@]}" -n 14 tests/test_cuda.py \
  -k "not on_hopper and not on_cuda or test_backward_in_grid_order_on_cuda" >"$out/tests.log" 2>&1
tail -2 "$out/tests.log"; grep -E "^FAILED|^ERROR" "$out/tests.log" | head -10; echo "== tests $(elapsed)"
B=(python3 -m jax_flash.benchmark --platform gpu --reps 5 --causal yes)
{
  for order in longest grid; do
    echo "### order $order: hd128 MHA seq 4096 8192 (cuDNN beside)"
    env JAX_FLASH_CUDA_ORDER=$order timeout 75 "${B[@]}" --seqs 4096 8192 --head-dims 128 --skip xla pallas tokamax --out "$runs/mha_$order" 2>"$runs/mha_${order}_progress.log"
    echo "== mha $order $(elapsed)"
    echo "### order $order: GQA 32/8 and MQA 16/1, hd128 seq 4096 (cuDNN, tokamax beside)"
    env JAX_FLASH_CUDA_ORDER=$order timeout 70 "${B[@]}" --seqs 4096 --head-dims 128 --heads 32 --kv-heads 8 --skip xla pallas --out "$runs/gqa_$order" 2>"$runs/gqa_${order}_progress.log"
    env JAX_FLASH_CUDA_ORDER=$order timeout 70 "${B[@]}" --seqs 4096 --head-dims 128 --heads 16 --kv-heads 1 --skip xla pallas --out "$runs/mqa_$order" 2>"$runs/mqa_${order}_progress.log"
    echo "== gqa mqa $order $(elapsed)"
  done
} 2>&1 | tee "$out/bench.log"
tar czf "$out/runs.tgz" "$runs"
echo "== done $(elapsed)"
