#!/usr/bin/env bash
# Session 43, call 2: the plain forwards mask a block only where a live row sees part of it
# (gpu/block_geometry.cuh live_rows_need_mask). Call 1's timeline: the 192-row tiles' last query
# block (128 live rows at seq 8192, 64 at 4096) masked every block for its rows past the
# sequence and ran its loop at ~4500 cycles a block against ~2950. (1) The committed modules
# (base, carried in build/baseline) beside this tree's default and its 192-row tiles on the
# tile counter for the causal calls too (wide_dynamic), each in its own process with cuDNN and
# tokamax; (2) the NaN-propagation cases on CUDA (a NaN in a padding row among them) and the
# forward's tile choices' reference cases.
#   run from the repository root on the GPU machine: bash examples/results/h200/session43/call2/call.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-470} source .ci/gpu/call_preamble.sh  # (step, bench_variants)
bench_variants 70 base=base default=tree \
  wide_dynamic=JAX_FLASH_CUDA_FORWARD=sm90ws_wide,JAX_FLASH_CUDA_FWD_GRID=dynamic -- \
  --seqs ${SEQS:-2048 4096 8192} --head-dims 64 --causal both
step poison 120 "${PT[@]}" -n 8 tests/test_nan_propagation.py -k cuda
step tiles 200 "${PT[@]}" tests/test_cuda.py -k "test_forward_tile_choices_on_hopper"
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
