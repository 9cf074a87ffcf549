#!/usr/bin/env bash
# Session 42, call 1: head dim 64's forward. (1) The CHAIN timeline (session 41's third level: the
# tiles' phases and of each block only S in, the exponentials done and the conversion) of the
# committed kernels, built on the development machine and run from a copy of the package. (2) Three
# experimental kernels (gpu/tile_shapes.cuh, plain calls only) beside this tree's default and
# the existing 192-row tiles, each in its own process with cuDNN and tokamax: S issued two blocks
# ahead of its softmax (sm90ws_scoresahead), a third K/V stage (sm90ws_deepring), 128 x 192 tiles
# (sm90ws_longkeys), the 192-row tiles causal too (sm90ws_wide). The experiments' reference cases
# run in call 2.
#   run from the repository root on the GPU machine: bash examples/results/h200/session42/call1/call.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-560} source .ci/gpu/call_preamble.sh  # (step, bench_variants)
script=$PWD/.ci/gpu/fwd_timeline.py
bash .ci/gpu/package_copy.sh /tmp/tl_CHAIN build/timeline_CHAIN >/dev/null
timeline() {
  local name=$1; shift
  mkdir -p "$runs/CHAIN"
  (cd /tmp/tl_CHAIN && PYTHONPATH=/tmp/tl_CHAIN timeout -s KILL 60 python3 "$script" --out "$OLDPWD/$runs/CHAIN" "$@") \
    >>"$out/CHAIN.md" 2>"$runs/CHAIN/$name.err"
  echo "== CHAIN $name rc=$? $(elapsed)"; tail -2 "$runs/CHAIN/$name.err"
}
timeline hd64_causal --head-dim 64 --causal
timeline hd64_noncausal --head-dim 64
timeline hd64_causal_1024 --head-dim 64 --causal --seq 1024
grep -E "^# |^\| (loop |tile|first_s|.*->tile)" "$out/CHAIN.md" | cut -c1-160 | head -60
bench_variants 75 default=tree scoresahead=JAX_FLASH_CUDA_FORWARD=sm90ws_scoresahead \
  deepring=JAX_FLASH_CUDA_FORWARD=sm90ws_deepring longkeys=JAX_FLASH_CUDA_FORWARD=sm90ws_longkeys \
  wide=JAX_FLASH_CUDA_FORWARD=sm90ws_wide -- --seqs 2048 8192 --head-dims 64 --causal both
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
