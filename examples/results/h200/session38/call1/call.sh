#!/usr/bin/env bash
# Session 38, call 1: session 37's call 1 left the 640-tile forward test with no result in 100 s
# (test_forward_of_more_tiles_than_sms*, default turns per tile: the hang of v34 in the plain
# forward?). Each tile grid with its turns per tile and across tiles, side by side, each process
# capped; then the reference cases under across_tiles; then the plain forward's times both ways
# beside cuDNN and tokamax (session 37's call 2, first part).
#   run from the repository root on the GPU machine: bash examples/results/h200/session38/call1/call.sh
set -uo pipefail
source .ci/gpu/call_preamble.sh
probe() {  # $1 label, rest: environment assignments
  local label=$1; shift
  ( t0=$(date +%s); env "$@" timeout -s KILL 80 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short \
      tests/test_cuda.py -k test_forward_of_more_tiles_than_sms_here >"$runs/probe_$label.log" 2>&1
    echo "probe $label: rc=$? $(( $(date +%s) - t0 )) s $(tail -1 "$runs/probe_$label.log" | cut -c1-120)" ) &
}
probe default_per_tile
probe default_across JAX_FLASH_CUDA_FWD_TURNS=across_tiles
probe static_per_tile JAX_FLASH_CUDA_FORWARD=sm90ws_static
probe static_across JAX_FLASH_CUDA_FORWARD=sm90ws_static JAX_FLASH_CUDA_FWD_TURNS=across_tiles
probe dynamic_per_tile JAX_FLASH_CUDA_FORWARD=sm90ws_dynamic
probe dynamic_across JAX_FLASH_CUDA_FORWARD=sm90ws_dynamic JAX_FLASH_CUDA_FWD_TURNS=across_tiles
wait; echo "probes $(elapsed)"
export XLA_FLAGS=--xla_gpu_autotune_level=0
JAX_FLASH_CUDA_FWD_TURNS=across_tiles timeout -s KILL 170 "${PT[@]}" -n 14 tests/test_cuda.py \
  -k test_cuda_matches_reference >"$out/reference_across.log" 2>&1
echo "reference cases across_tiles: rc=$? $(tail -1 "$out/reference_across.log") $(elapsed)"
grep -E "^FAILED|^ERROR" "$out/reference_across.log" | head -12
unset XLA_FLAGS
for turns in across_tiles per_tile; do
  (( $(left) > 60 )) || { echo "== plain_$turns: skipped (time)"; continue; }
  JAX_FLASH_CUDA_FWD_TURNS=$turns timeout -s KILL $(( $(left) - 20 )) python3 -m jax_flash.benchmark --platform gpu \
    --reps 5 --seqs 4096 --causal both --skip xla pallas --head-dims 64 128 --out "$runs/plain_$turns" \
    2>"$runs/plain_${turns}_progress.log" >"$out/plain_$turns.md"
  echo "== plain_$turns $(elapsed)"; grep -E "^\| [0-9]" "$out/plain_$turns.md" | cut -c1-200
done
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
