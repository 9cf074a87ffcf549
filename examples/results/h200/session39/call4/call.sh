#!/usr/bin/env bash
# Session 39, call 4: call 3 showed the causal hd64 forward at seq 4096 latency-bound (tensor pipe
# 40% vs cuDNN's 46.5%, the same instruction count, IPC 1.67 vs 2.00, "wait" stalls 38% of ours):
# the stall samples per SASS instruction of our kernel and of cuDNN's (Nsight Compute's source
# page as CSV), to see which dependencies wait.
#   run from the repository root on the GPU machine: bash examples/results/h200/session39/call4/call.sh
set -uo pipefail
source .ci/gpu/call_preamble.sh  # (step, bench)
NCU=/usr/local/cuda/bin/ncu
SHAPE=(--seq 4096 --head-dim 64 --causal --forward-only)
step ncu_src_ours 60 $NCU --clock-control none -c 1 --section SourceCounters --section WarpStateStats \
  -o "$runs/ours" -k regex:flash_fwd python3 .ci/gpu/profile_attention.py "${SHAPE[@]}"
step ncu_src_cudnn 60 $NCU --clock-control none -c 1 --section SourceCounters --section WarpStateStats \
  -o "$runs/cudnn" -k 'regex:(?i)(sdpa|fmha|flash|attn|fprop)' python3 .ci/gpu/profile_attention.py "${SHAPE[@]}" --peer cudnn
for who in ours cudnn; do
  timeout -s KILL 40 $NCU -i "$runs/$who.ncu-rep" --page source --csv --print-source sass >"$runs/src_$who.csv" 2>&1
  echo "source page $who: rc=$? $(wc -l <"$runs/src_$who.csv") lines $(elapsed)"; head -3 "$runs/src_$who.csv" | cut -c1-300
  timeout -s KILL 40 $NCU -i "$runs/$who.ncu-rep" --page details --print-details all >"$runs/details_$who.txt" 2>&1
done
rm -f "$runs"/*.ncu-rep
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
