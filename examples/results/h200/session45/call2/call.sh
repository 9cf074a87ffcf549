#!/usr/bin/env bash
# Session 45, call 2: head dim 64's forward at seq 1024-8192 under the two experimental layouts:
# this tree's default (192-row tiles from row 0, every warpgroup computing every block of its
# tile), the end-aligned tiles (JAX_FLASH_CUDA_FWD_ROWS=end), the unseen blocks skipped
# (JAX_FLASH_CUDA_FWD_UNSEEN=skip) and both; causal, then non-causal (where the skip drops the
# warpgroups made wholly of padding rows); then head dim 128 causal (128-row tiles, which meet
# unseen blocks only with T != S, windows or lengths) with and without the skip, to see that the
# skip's code costs the plain loop nothing. Each variant in its own process with cuDNN and tokamax.
#   run from the repository root on the GPU machine: bash examples/results/h200/session45/call2/call.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-560} source .ci/gpu/call_preamble.sh  # (bench_variants)
seqs=${SEQS:-1024 2048 4096 8192}
bench_variants 80 default=tree end=JAX_FLASH_CUDA_FWD_ROWS=end skip=JAX_FLASH_CUDA_FWD_UNSEEN=skip \
  end_skip=JAX_FLASH_CUDA_FWD_ROWS=end,JAX_FLASH_CUDA_FWD_UNSEEN=skip -- --seqs $seqs --head-dims 64 --causal yes
bench_variants 60 default_nc=tree end_skip_nc=JAX_FLASH_CUDA_FWD_ROWS=end,JAX_FLASH_CUDA_FWD_UNSEEN=skip -- \
  --seqs $seqs --head-dims 64 --causal no
bench_variants 45 default128=tree skip128=JAX_FLASH_CUDA_FWD_UNSEEN=skip -- --seqs 2048 8192 --head-dims 128 --causal yes
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
