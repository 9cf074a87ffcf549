#!/usr/bin/env bash
# Session 39, call 2: a share of the Hopper forward's exponentials on the FMA pipe
# (JAX_FLASH_CUDA_EXP2=fma8 | fma4, gpu/exp2_fma.cuh): at head dim 64 a block's exponentials keep
# the MUFU as long as its products keep the tensor cores. The plain rows under each setting (one
# process each, cuDNN and tokamax in each), the switch's tests, then head dim 64 at seq 1024 and
# 16384 under mufu and fma8.
#   run from the repository root on the GPU machine: bash examples/results/h200/session39/call2/call.sh
set -uo pipefail
source .ci/gpu/call_preamble.sh  # (step, bench)
bench plain_mufu 50 --head-dims 64 128
JAX_FLASH_CUDA_EXP2=fma8 bench plain_fma8 50 --head-dims 64 128
JAX_FLASH_CUDA_EXP2=fma4 bench plain_fma4 50 --head-dims 64 128
XLA_FLAGS=--xla_gpu_autotune_level=0 step exp2_tests 200 "${PT[@]}" -n 2 tests/test_cuda.py -k exp2_on_the_fma_pipe
bench hd64_mufu 50 --head-dims 64 --seqs 1024 16384
JAX_FLASH_CUDA_EXP2=fma8 bench hd64_fma8 50 --head-dims 64 --seqs 1024 16384
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
