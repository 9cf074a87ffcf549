#!/usr/bin/env bash
# Session 37, call 2 (after session 36's call 1 ran the arrays' tests): the plain forward at seq
# 4096 beside cuDNN and tokamax with its turns per tile (the default) and across tiles
# (JAX_FLASH_CUDA_FWD_TURNS; cuda/PERF_NOTES.md v34), then the bias differentiated
# (--bias-grad: dbias formed, none of the earlier bias figures did) and the mask array's rows,
# then the GPU suite's other files as time allows.
#   run from the repository root on the GPU machine: bash examples/results/h200/session37/call2/call.sh
set -uo pipefail
source .ci/gpu/call_preamble.sh  # (bench: as this script had it)
for turns in per_tile across_tiles; do
  JAX_FLASH_CUDA_FWD_TURNS=$turns bench "plain_$turns" 150 --head-dims 64 128
done
JAX_FLASH_CUDA_LOGIT_ARRAYS=on bench bias_grad 120 --head-dims 128 --bias-grad
JAX_FLASH_CUDA_LOGIT_ARRAYS=on bench mask 120 --head-dims 128 --mask
if (( $(left) > 90 )); then
  XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL $(( $(left) - 15 )) "${PT[@]}" -n 14 tests/test_alibi.py \
    tests/test_softcap.py tests/test_segment_ids.py tests/test_cuda_block_sparse.py tests/test_sinks.py \
    tests/test_value_head_dim.py tests/test_dropout.py -k "not differential and not on_hopper and not on_cuda" \
    >"$out/suite_others.log" 2>&1
  echo "other GPU files: $(tail -1 "$out/suite_others.log") $(elapsed)"; grep -E "^FAILED|^ERROR" "$out/suite_others.log" | head -20
fi
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
