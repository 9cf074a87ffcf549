#!/usr/bin/env bash
# Session 52, call A2 (run inline right after call A, same warm H100 and carry): the switch's test
# selections run directly at -n 10 (call A's subprocess form outlasted its 200 s step), on the
# Hopper kernels and on the mma.sync ones.
export BUDGET_S=400; set -uo pipefail; source .ci/gpu/call_preamble.sh
SEL="test_cuda_matches_reference or test_deterministic_matches_reference or test_forward_only_matches_reference or test_forward_splits_o_as_xla_would or test_command_buffer_capture or test_jit_training_step_reduces_loss or test_poisoned_inputs_on_cuda or test_cuda_kernels_write_every_output_element"
step vec_hopper 170 env JAX_FLASH_CUDA_FWD_STORES=vectors "${PT[@]}" -n 10 -rf tests/test_cuda.py tests/test_nan_propagation.py -k "$SEL"
step vec_sm80 170 env JAX_FLASH_CUDA_FWD_STORES=vectors JAX_FLASH_CUDA_FORWARD=sm80 "${PT[@]}" -n 10 -rf tests/test_cuda.py tests/test_nan_propagation.py -k "$SEL"
