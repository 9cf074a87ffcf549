#!/usr/bin/env bash
# Session 43, call 1: where head dim 64's causal forward loses its speed. Session 43's first call
# (session 42's call 2, run on an H100) found the deal of the tiles is not it: at seq 8192 the
# causal forward reads 387-398 TFLOP/s however the tiles are dealt and on two or three warpgroups,
# where the non-causal forward on three warpgroups reads ~470. (1) The CHAIN timeline (session 42's
# committed-kernel debug build) of the three-warpgroup tiles causal and not, and of the
# two-warpgroup tiles causal and not, at seq 4096 and 8192: the loop's period and the tiles'
# fixed costs of each. (2) The two-warpgroup tiles without the mask (sm90ws_narrow) beside the
# default, each in its own process with cuDNN and tokamax.
#   run from the repository root on the GPU machine: bash examples/results/h200/session43/call1/call.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-300} source .ci/gpu/call_preamble.sh  # (step, bench_variants)
script=$PWD/.ci/gpu/fwd_timeline.py
bash .ci/gpu/package_copy.sh /tmp/tl_CHAIN build/timeline_CHAIN >/dev/null
# `timeline NAME FORWARD_FAMILY ARGS...`
timeline() {
  local name=$1 family=$2; shift 2
  mkdir -p "$runs/CHAIN"
  echo "# $name ($family $*)" >>"$out/CHAIN.md"
  (cd /tmp/tl_CHAIN && JAX_FLASH_CUDA_FORWARD=$family PYTHONPATH=/tmp/tl_CHAIN timeout -s KILL 60 \
    python3 "$script" --out "$OLDPWD/$runs/CHAIN/$name" "$@") >>"$out/CHAIN.md" 2>"$runs/CHAIN/$name.err"
  echo "== CHAIN $name rc=$? $(elapsed)"; tail -2 "$runs/CHAIN/$name.err"
}
for seq in 4096 8192; do
  timeline wide_causal_$seq sm90ws_wide --head-dim 64 --causal --seq $seq
  timeline wide_noncausal_$seq sm90ws_wide --head-dim 64 --seq $seq
  timeline narrow_causal_$seq sm90ws_narrow --head-dim 64 --causal --seq $seq
  timeline narrow_noncausal_$seq sm90ws_narrow --head-dim 64 --seq $seq
done
grep -E "^# |^\| (loop |tile|first_s|.*->tile)" "$out/CHAIN.md" | cut -c1-160 | head -90
bench_variants 60 default=tree narrow=JAX_FLASH_CUDA_FORWARD=sm90ws_narrow -- \
  --seqs 2048 8192 --head-dims 64 --causal both
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
