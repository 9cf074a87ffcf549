#!/usr/bin/env bash
# Session 44, call 1: session 43's call 2 (never run) with the end-aligned tiles beside it.
# (1) Head dim 64: the default and the 128-row tiles everywhere (narrow), causal and not; then,
# causal only, the 192-row tiles on the tile counter (wide_dynamic: since ed81c2f a tile's rows
# past the sequence no longer mask its every key block) and the same with the tiles laid against
# the sequence's end (wide_end: JAX_FLASH_CUDA_FWD_ROWS=end, the padding rows in the first tile,
# which sees the fewest key blocks); each in its own process with cuDNN and tokamax.
# (2) The NaN-propagation cases on CUDA (a NaN in a padding row among them: ed81c2f's semantics)
# and the end-aligned tiles' reference cases.
#   run from the repository root on the GPU machine: bash examples/results/h200/session44/call1/call.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-540} source .ci/gpu/call_preamble.sh  # (step, bench_variants)
seqs=(${SEQS:-2048 4096 8192})
bench_variants 80 default=tree narrow=JAX_FLASH_CUDA_FORWARD=sm90ws_narrow -- \
  --seqs "${seqs[@]}" --head-dims 64 --causal both
bench_variants 60 wide_dynamic=JAX_FLASH_CUDA_FORWARD=sm90ws_wide,JAX_FLASH_CUDA_FWD_GRID=dynamic \
  wide_end=JAX_FLASH_CUDA_FORWARD=sm90ws_wide,JAX_FLASH_CUDA_FWD_GRID=dynamic,JAX_FLASH_CUDA_FWD_ROWS=end -- \
  --seqs "${seqs[@]}" --head-dims 64 --causal yes
step poison 90 "${PT[@]}" -n 8 tests/test_nan_propagation.py -k cuda
step endrows 150 "${PT[@]}" tests/test_cuda.py -k "test_forward_end_aligned_rows_on_hopper"
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
