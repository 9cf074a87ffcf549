#!/usr/bin/env bash
# Session 41, call 3: the inference forward with the softmax's row sums from the tensor cores
# alone (JAX_FLASH_CUDA_FORWARD=sm90ws_tmasums: no float additions of P in the softmax; O and lse
# from the sums of the 16-bit P) against this tree's default (a353a46's kernels, call 1's
# `base`), each in its own process beside cuDNN and tokamax; then the switch's own cases, then
# the CUDA suite's main files in what time is left (XLA's autotuning off: call_preamble's PT).
#   run from the repository root on the GPU machine: bash examples/results/h200/session41/call3/call.sh
set -uo pipefail
BUDGET_S=280 source .ci/gpu/call_preamble.sh  # (step, bench)
bench_variants 90 default=tree tmasums=JAX_FLASH_CUDA_FORWARD=sm90ws_tmasums -- \
  --seqs 1024 4096 --head-dims 64 128 --causal both
step switch 120 "${PT[@]}" tests/test_cuda.py -k "tensor_sums_when_stored_by_tma"
step suite 190 "${PT[@]}" -n 14 tests/test_cuda.py tests/test_cuda_ffi_validation.py tests/test_value_head_dim.py \
  -k "not differential and not on_hopper and not on_cuda"
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
