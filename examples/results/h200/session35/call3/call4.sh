#!/usr/bin/env bash
# Session 35, call 4: the stalled forwards of call 3 (causal calls whose tiles visit one key block,
# through the arrays' kernel with the ids' code), narrowed: each configuration of
# probe_forward.py in a process of its own under a 50 s timeout.
#   run from the repository root on the GPU machine: bash examples/results/h200/session35/call3/call4.sh
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_FLASH_CUDA_LOGIT_ARRAYS=on
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
source .ci/gpu/prebuilt.sh use || exit 1
for c in f32bias-noncausal-1block f32bias-causal-1block mask-causal-1block ids-causal-1block f32bias-window-1block \
         bf16bias-mask-causal-staged f32bias-causal-2blocks f32bias-noncausal-2blocks; do
  (timeout -s KILL 50 python3 examples/results/h200/session35/call3/probe_forward.py "$c" >"$runs/pf_$c.log" 2>&1
   echo "$c rc=$? $(grep -E 'done$' "$runs/pf_$c.log" | sed 's/.*: //' | tr '\n' ' ')") &
done 2>/dev/null
wait
for f in "$runs"/pf_*.log; do grep -qE "Traceback|Error" "$f" && { echo "== $f"; tail -4 "$f" | cut -c1-300; }; done
echo "== done $(elapsed)"
