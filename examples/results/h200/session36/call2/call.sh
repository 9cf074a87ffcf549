#!/usr/bin/env bash
# Session 36, call 2: the turn barrier's change is every Hopper forward's (cuda/PERF_NOTES.md
# v34): the GPU suite's other files (score variants, segment ids, block-sparse, sinks, value head
# dims, dropout, decode), then the plain forward at seq 4096 beside cuDNN and tokamax (head dims
# 64 and 128, causal and not) with its turns per tile and across tiles (JAX_FLASH_CUDA_FWD_TURNS).
#   run from the repository root on the GPU machine: bash examples/results/h200/session36/call2/call.sh
set -uo pipefail
source .ci/gpu/call_preamble.sh
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 240 "${PT[@]}" -n 14 tests/test_alibi.py tests/test_softcap.py \
  tests/test_segment_ids.py tests/test_cuda_block_sparse.py tests/test_sinks.py tests/test_value_head_dim.py \
  tests/test_dropout.py -k "not differential and not on_hopper and not on_cuda" >"$out/suite_others.log" 2>&1
echo "other GPU files: $(tail -1 "$out/suite_others.log") $(elapsed)"; grep -E "^FAILED|^ERROR" "$out/suite_others.log" | head -20
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 150 "${PT[@]}" -n 8 tests/test_cuda_decode.py \
  >"$out/suite_decode.log" 2>&1
echo "decode file: $(tail -1 "$out/suite_decode.log") $(elapsed)"; grep -E "^FAILED|^ERROR" "$out/suite_decode.log" | head -10
# The plain forward with its turns restarted at each tile (the default) and run on across tiles.
for turns in per_tile across_tiles; do
  (( $(left) > 100 )) || break
  JAX_FLASH_CUDA_FWD_TURNS=$turns timeout -s KILL $(( $(left) - 10 )) python3 -m jax_flash.benchmark --platform gpu \
    --reps 5 --seqs 4096 --causal both --head-dims 64 128 --skip xla pallas \
    --out "$runs/plain_$turns" 2>"$runs/plain_${turns}_progress.log" >"$out/plain_$turns.md"
  echo "== benchmark (plain, $turns) $(elapsed)"; grep -E "^\| [0-9]" "$out/plain_$turns.md" | cut -c1-200
done
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
