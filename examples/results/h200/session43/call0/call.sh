#!/usr/bin/env bash
# Session 42, call 2: why head dim 64's causal forward loses a quarter of its non-causal speed
# (call 1: 364 vs 471 TFLOP/s at seq 8192, where cuDNN and tokamax lose nothing). The grid's
# deal of the causal tiles (JAX_FLASH_CUDA_FWD_GRID, session 42): this tree's default (static
# pairs) against the tile counter and a CTA per tile, on the 128 x 128 tiles and on the 192-row
# tiles of the non-causal calls (sm90ws_wide), with call 1's 128 x 192 tiles (sm90ws_longkeys) and
# the default again, each in its own process beside cuDNN and tokamax; then the experimental tile
# choices' reference cases.
# Not run in session 42: the pool refused six starts.
#   run from the repository root on the GPU machine: bash examples/results/h200/session42/call2/call.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-330} source .ci/gpu/call_preamble.sh  # (step, bench_variants)
f=JAX_FLASH_CUDA_FORWARD g=JAX_FLASH_CUDA_FWD_GRID
bench_variants 60 default=tree dynamic=$g=dynamic wide_dynamic=$f=sm90ws_wide,$g=dynamic \
  wide_pertile=$f=sm90ws_wide,$g=per_tile longkeys_dynamic=$f=sm90ws_longkeys,$g=dynamic default2=tree -- \
  --seqs 2048 8192 --head-dims 64 --causal yes
step switches 170 "${PT[@]}" tests/test_cuda.py -k "experimental_forward_tiles and not scoresahead"
step grids 200 "${PT[@]}" tests/test_cuda.py -k "forward_grid_override or unknown_kernel_choice"
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
