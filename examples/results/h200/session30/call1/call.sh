#!/usr/bin/env bash
# Session 30 call 1. 61fa2f7's head-dim-192 selection (compiled, never run) and the soft cap's
# CUDA cases; the value head dim's tests (the pair kernels of 192 / 128 under
# JAX_FLASH_CUDA_VALUE_HEAD_DIM=native in their subprocess); issue 17's 192 / 128 figure with
# tokamax: padded (the default), native, native on the wide tiles.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -1 "$out/build.log"
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short)
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 220 "${PT[@]}" -n 14 tests/test_cuda.py tests/test_softcap.py \
  tests/test_value_head_dim.py \
  -k "((test_cuda_matches_reference or test_deterministic_matches_reference) and (h136 or h160 or h192)) or (test_softcap and cuda) or test_value_head_dim" \
  >"$out/tests.log" 2>&1
echo "tests: $(tail -1 "$out/tests.log") $(elapsed)"; grep -E "^FAILED|^ERROR" "$out/tests.log" | head -20
source .ci/gpu/tokamax_peer.sh
B=(python3 -m jax_flash.benchmark --platform gpu --reps 5 --seqs 4096 8192 --head-dims 192 --value-head-dim 128
   --causal both --skip xla pallas)
for mode in padded native wide; do
  env=(JAX_FLASH_CUDA_VALUE_HEAD_DIM=$([[ $mode == padded ]] && echo padded || echo native))
  [[ $mode == wide ]] && env+=(JAX_FLASH_CUDA_FORWARD=sm90ws_wide)
  env "${env[@]}" timeout -s KILL 100 "${B[@]}" --out "$runs/$mode" 2>"$runs/${mode}_progress.log" >"$out/value_head_dim_$mode.md"
  echo "== $mode $(elapsed)"; grep -E "^\| [0-9]" "$out/value_head_dim_$mode.md" | cut -d'|' -f2-12
done
tar czf "$out/runs.tgz" "$runs"
echo "== done $(elapsed)"
