#!/usr/bin/env bash
# Session 52, call A4 (inline, same warm H100): every -m gpu file but the decode file and the
# subprocess selections, under the 16-byte stores, at -n 8 (cut by its 340 s step).
export BUDGET_S=370; set -uo pipefail; source .ci/gpu/call_preamble.sh
step gpu_suite_vectors 340 env JAX_FLASH_CUDA_FWD_STORES=vectors "${PT[@]}" -n 8 -rf tests/ --ignore=tests/test_cuda_decode.py -k "not on_hopper and not on_cuda"
