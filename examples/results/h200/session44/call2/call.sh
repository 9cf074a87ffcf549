#!/usr/bin/env bash
# Session 44, call 2. Call 1's end-aligned tiles (JAX_FLASH_CUDA_FWD_ROWS=end) ran faster but their
# first test case failed, its output lost with the step's kill: (1) whether a TMA box that starts
# before row 0 loads zeros there and stores nothing there (tma_negative_rows.cu); (2) the
# end-aligned reference cases run directly with their failures printed; (3) this tree's default,
# whose head-dim-64 causal calls now take the 192-row tiles on the tile counter (call 1), on the
# reference cases of head dims 33..64, the forward-only cases, the NaN cases and the graph
# capture; (4) head dim 64 causal: the default, the 128-row tiles (narrow) and the end-aligned
# tiles, seq 1024-8192, each in its own process with cuDNN and tokamax.
#   run from the repository root on the GPU machine: bash examples/results/h200/session44/call2/call.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-420} source .ci/gpu/call_preamble.sh  # (step, bench_variants)
here=examples/results/h200/session44/call2
step tma_negative 60 bash -c "nvcc -I cuda -std=c++17 -gencode=arch=compute_90a,code=sm_90a \
  $here/tma_negative_rows.cu cuda/sm90/tensor_map.cu -o /tmp/tneg && /tmp/tneg"
cat "$out/tma_negative.log"
ref="test_cuda_matches_reference or test_forward_only_matches_reference"
step endrows 90 env JAX_FLASH_CUDA_FWD_ROWS=end "${PT[@]}" -n 8 -x tests/test_cuda.py \
  -k "($ref) and (h40 or h64 or h128 or h256)"
step endrows_wide 60 env JAX_FLASH_CUDA_FWD_ROWS=end JAX_FLASH_CUDA_FORWARD=sm90ws_wide "${PT[@]}" -n 8 -x \
  tests/test_cuda.py -k "($ref) and (h40 or h64)"
step default_h64 90 "${PT[@]}" -n 8 tests/test_cuda.py \
  -k "(($ref) and (h40 or h64)) or test_forward_only or test_command_buffer_capture"
step poison 40 "${PT[@]}" -n 8 tests/test_nan_propagation.py -k cuda
bench_variants 50 default=tree narrow=JAX_FLASH_CUDA_FORWARD=sm90ws_narrow \
  end=JAX_FLASH_CUDA_FWD_ROWS=end -- --seqs ${SEQS:-1024 2048 4096 8192} --head-dims 64 --causal yes
mv "$out"/*.log "$runs"/  # (at most 8 files come back: the tables, and the logs in the tar)
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
