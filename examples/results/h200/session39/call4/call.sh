#!/usr/bin/env bash
# Session 39, call 4: call 3 showed the causal hd64 forward latency-bound (the same instruction
# count as cuDNN's at IPC 1.67 vs 2.00, "wait" stalls 38% of ours). This tree's softmax sums each
# row half's exponentials in four partial sums and its maxima in two (a chain of dependent adds,
# one a score, before), against the committed modules (build/baseline, stamp 6b0c398f), each in
# its own process beside cuDNN; then, as time allows, the stall samples per SASS instruction of
# this tree's kernel and of cuDNN's (Nsight Compute's source page as CSV).
#   run from the repository root on the GPU machine: bash examples/results/h200/session39/call4/call.sh
set -uo pipefail
source .ci/gpu/call_preamble.sh  # (step, bench)
base=/tmp/base; rm -rf $base; mkdir -p $base; cp -r jax_flash $base/
xz -dc build/baseline/_native_cuda.so.xz >$base/jax_flash/_native_cuda.cpython-312-x86_64-linux-gnu.so
cp build/baseline/_native.cpython-312-x86_64-linux-gnu.so $base/jax_flash/
B=(python3 -m jax_flash.benchmark --platform gpu --reps 5 --seqs 4096 --head-dims 64 128 --causal both --skip xla pallas tokamax)
(cd $base && PYTHONPATH=$base timeout -s KILL 60 "${B[@]}" --out "$OLDPWD/$runs/base" 2>"$OLDPWD/$runs/base_progress.log") >"$out/bench_base.md"
echo "== base $(elapsed)"; grep -E "^\| [0-9]" "$out/bench_base.md" | grep fwd | cut -c1-120
timeout -s KILL 60 "${B[@]}" --out "$runs/new" 2>"$runs/new_progress.log" >"$out/bench_new.md"
echo "== new $(elapsed)"; grep -E "^\| [0-9]" "$out/bench_new.md" | grep fwd | cut -c1-120
NCU=/usr/local/cuda/bin/ncu
SHAPE=(--seq 4096 --head-dim 64 --causal --forward-only)
step ncu_src_ours 40 $NCU --clock-control none -c 1 --section SourceCounters --section WarpStateStats \
  -o "$runs/ours" -k regex:flash_fwd python3 .ci/gpu/profile_attention.py "${SHAPE[@]}"
step ncu_src_cudnn 40 $NCU --clock-control none -c 1 --section SourceCounters --section WarpStateStats \
  -o "$runs/cudnn" -k 'regex:(?i)(sdpa|fmha|flash|attn|fprop)' python3 .ci/gpu/profile_attention.py "${SHAPE[@]}" --peer cudnn
for who in ours cudnn; do
  [[ -f $runs/$who.ncu-rep ]] || continue
  timeout -s KILL 20 $NCU -i "$runs/$who.ncu-rep" --page source --csv --print-source sass >"$runs/src_$who.csv" 2>&1
  echo "source page $who: rc=$? $(wc -l <"$runs/src_$who.csv") lines $(elapsed)"
done
rm -f "$runs"/*.ncu-rep
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
