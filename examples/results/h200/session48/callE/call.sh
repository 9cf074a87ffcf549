#!/usr/bin/env bash
# Session 48, call E: head dim 256's forward at seq 1024-2048 (0.71-0.94x cuDNN in call D) under
# the existing kernel choices, each in its own process with cuDNN and tokamax: the default (key
# blocks of 80, tiles from the counter or the static pairs), the 64-key tiles
# (JAX_FLASH_CUDA_FORWARD=sm90ws_narrow), a CTA per tile, and the counter on every mask.
#   run from the repository root on the GPU machine: bash examples/results/h200/session48/callE/call.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-230} source .ci/gpu/call_preamble.sh  # (bench_variants)
bench_variants ${VARIANT_S:-50} default=tree narrow=JAX_FLASH_CUDA_FORWARD=sm90ws_narrow \
  per_tile=JAX_FLASH_CUDA_FWD_GRID=per_tile dynamic=JAX_FLASH_CUDA_FWD_GRID=dynamic -- \
  --seqs ${SEQS:-1024 2048} --head-dims 256 --causal both
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
