#!/usr/bin/env bash
# Session 38, call 2: after call 1 (the forward's turns per tile hung at 640 tiles; across tiles
# passed and cost nothing) the turns run on across tiles in every forward, and the backward runs
# the batch's CTAs of a key block side by side where the batch shares a dbias. In order: the
# arrays' GPU tests, the bias differentiated with the new order and the grid's
# (JAX_FLASH_CUDA_ORDER=grid) beside cuDNN and tokamax, the CUDA suite's main files (the 640-tile
# test under each grid among them), then the plain forward's rows and one memcheck as time allows.
#   run from the repository root on the GPU machine: bash examples/results/h200/session38/call2/call.sh
set -uo pipefail
source .ci/gpu/call_preamble.sh  # (step, bench)
XLA_FLAGS=--xla_gpu_autotune_level=0 JAX_FLASH_CUDA_LOGIT_ARRAYS=on step array_tests 60 "${PT[@]}" -n 8 \
  tests/test_cuda_logit_arrays.py -k "against_jax_nn or row_the_mask or block_diagonal"
JAX_FLASH_CUDA_LOGIT_ARRAYS=on bench bias_grad 55 --head-dims 128 --bias-grad
JAX_FLASH_CUDA_LOGIT_ARRAYS=on JAX_FLASH_CUDA_ORDER=grid bench bias_grad_grid_order 55 --head-dims 128 --bias-grad
XLA_FLAGS=--xla_gpu_autotune_level=0 step cuda_suite 210 "${PT[@]}" -n 14 tests/test_cuda.py \
  tests/test_cuda_ffi_validation.py tests/test_value_head_dim.py -k "not differential and not on_hopper and not on_cuda"
(( $(left) > 120 )) && bench plain 90 --head-dims 64 128
step memcheck_tma 45 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --print-limit 4 \
  python3 .ci/gpu/sanitize_cases.py --logit-arrays --cases 1,5
grep -E "^case|SUMMARY" "$out/memcheck_tma.log" | head -6
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
