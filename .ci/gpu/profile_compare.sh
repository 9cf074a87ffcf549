#!/usr/bin/env bash
# Nsight Compute's view of our forward and main backward kernels beside cuDNN's, one
# differentiated step each (.ci/gpu/profile_attention.py), with the sections that say where the
# warps wait: warp states (stall reasons), the schedulers' issue rate, the pipes' activity
# (tensor, FMA, MUFU) and the memory workload. Writes a compact text report per peer to $OUT (or
# ./profile_out) and prints the lines that compare.
#   usage: bash .ci/gpu/profile_compare.sh [--seq 4096] [--head-dim 128] [--causal]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out=${OUT:-profile_out}; mkdir -p "$out"
ncu=/usr/local/cuda/bin/ncu
sections=(--section SpeedOfLight --section WarpStateStats --section SchedulerStats
          --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy
          # One --metrics (ncu takes the option once): the stall reasons and the pipes' activity.
          --metrics 'regex:smsp__warp_issue_stalled_.*_per_warp_active\.pct|sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active')
for peer in jax_flash cudnn; do
  # The attention kernels only: ours (flash_fwd/flash_bwd) and cuDNN's (sdpa ... fprop/bprop).
  timeout "${PROFILE_TIMEOUT:-240}" "$ncu" --clock-control none -k regex:'flash_(fwd|bwd)_sm90|flash_(fwd|bwd)_kernel|sdpa' \
    -c 2 "${sections[@]}" python3 .ci/gpu/profile_attention.py --peer "$peer" "$@" >"$out/ncu_full_$peer.txt" 2>&1
  echo "== $peer"
  grep -E "^  [a-zA-Z_].*\(|Duration|Compute \(SM\) Throughput|Issue Slots Busy|Issued Ipc|No Eligible|Warp Cycles Per Issued|Registers Per|Achieved Occupancy|L2 Hit|Mem Busy|stalled|pipe_" \
    "$out/ncu_full_$peer.txt" | awk '!/stalled/ || $NF+0 >= 1' | cut -c1-150 | head -90
done
