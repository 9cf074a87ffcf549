#!/usr/bin/env bash
# Session 31, call 2: Nsight Compute on the two rows of issue 14 furthest from cuDNN, head dim
# 64's causal forward at seq 2048 and head dim 256's backward at seq 4096: our kernels and
# cuDNN's with the same sections, for the next sessions' work.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -3 "$out/build.log"; echo "build $(elapsed)"
NCU=(/usr/local/cuda/bin/ncu --clock-control none -c 1 --section SpeedOfLight --section SchedulerStats --section WarpStateStats
     --section MemoryWorkloadAnalysis --section Occupancy --metrics 'regex:smsp__warp_issue_stalled_.*_per_warp_active\.pct|sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active|lts__t_sectors_op_red.*sum|sm__inst_executed_pipe_.*sum')
profile() {  # $1: output name, $2: kernel regex, the rest: profile_attention.py's arguments
  local name=$1 regex=$2; shift 2
  timeout -s KILL 80 "${NCU[@]}" -k regex:"$regex" python3 .ci/gpu/profile_attention.py "$@" >"$runs/ncu_$name.txt" 2>&1
  echo "ncu $name: $(grep -c 'Duration' "$runs/ncu_$name.txt") kernel(s) $(elapsed)"
}
profile fwd_hd64_causal_ours 'flash_fwd' --seq 2048 --head-dim 64 --causal --forward-only
profile fwd_hd64_causal_cudnn '(?i)(sdpa|fmha|flash|attn|fprop)' --seq 2048 --head-dim 64 --causal --forward-only --peer cudnn
profile bwd_hd256_ours 'flash_bwd_sm90' --seq 4096 --head-dim 256
profile bwd_hd256_cudnn '(?i)(bprop|bwd|backward|dgrad)' --seq 4096 --head-dim 256 --peer cudnn
for f in "$runs"/ncu_*.txt; do
  echo "== $f"
  grep -E "^  [a-zA-Z_].*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|No Eligible|Registers Per|Achieved Occupancy|L2 Cache Throughput|DRAM Throughput|stalled|pipe_|lts__" "$f" \
    | awk '!/stalled/ || $NF+0 >= 2' | cut -c1-150 | head -70
done >"$out/ncu.log" 2>&1
tar czf "$out/runs.tgz" "$runs"; echo "== done $(elapsed)"
