#!/usr/bin/env bash
# Session 43, call 2 (written, not run: the pool refused the starts until the session's device
# time was spent). The plain forwards mask a block only where a live row sees part of it
# (gpu/block_geometry.cuh live_rows_need_mask, ed81c2f): call 1's timeline showed the 192-row
# tiles' last query block (128 live rows at seq 8192, 64 at 4096) masking every block for its
# rows past the sequence, its loop at ~4500 cycles a block against ~2950. (1) This tree's default
# beside its 192-row tiles on the tile counter for the causal calls too (wide_dynamic) and its
# 128-row tiles everywhere (narrow), each in its own process with cuDNN and tokamax (the
# non-causal default rows against call 1's: 411.3 / 468.2 TFLOP/s at seq 2048 / 8192);
# (2) the NaN-propagation cases on CUDA (a NaN in a padding row among them: the change's
# semantics), the forward's tile choices' and the tile deals' reference cases.
#   run from the repository root on the GPU machine: bash examples/results/h200/session43/call2/call.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-540} source .ci/gpu/call_preamble.sh  # (step, bench_variants)
bench_variants 70 default=tree wide_dynamic=JAX_FLASH_CUDA_FORWARD=sm90ws_wide,JAX_FLASH_CUDA_FWD_GRID=dynamic \
  narrow=JAX_FLASH_CUDA_FORWARD=sm90ws_narrow -- --seqs ${SEQS:-2048 4096 8192} --head-dims 64 --causal both
step poison 120 "${PT[@]}" -n 8 tests/test_nan_propagation.py -k cuda
step tiles 200 "${PT[@]}" tests/test_cuda.py -k "test_forward_tile_choices_on_hopper"
step grids 200 "${PT[@]}" -n 3 tests/test_cuda.py -k "test_forward_grid_override_on_hopper or unknown_kernel_choice"
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
