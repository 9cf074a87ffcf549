#!/usr/bin/env bash
# Session 35, call 1: where the staged bias's forward time goes (seq 4096, hd128, (1, N, T, S)
# bf16 bias): our forward beside the kernels it builds on (plain, segment ids, a mask array) and
# other bias shapes and dtypes, cuDNN and tokamax with the same bias (bias_forward_times.py), the
# direct loads in a second process; then Nsight Compute on the forward kernel with and without
# the bias and on cuDNN's with it.
#   run from the repository root on the GPU machine: bash examples/results/h200/session35/call1/call.sh
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
left() { echo $(( ${BUDGET_S:-560} - $(date +%s) + start )); }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -1 "$out/build.log"; echo "build $(elapsed)"
source .ci/gpu/tokamax_peer.sh
here=examples/results/h200/session35/call1
JAX_FLASH_CUDA_LOGIT_ARRAYS=on timeout -s KILL 200 python3 $here/bias_forward_times.py --label staged --peers 2>"$runs/times_staged.err" | tee "$out/times.log"
tail -3 "$runs/times_staged.err"; echo "$(elapsed)"
(( $(left) > 250 )) && JAX_FLASH_CUDA_LOGIT_ARRAYS=on JAX_FLASH_CUDA_BIAS_LOADS=direct timeout -s KILL 100 \
  python3 $here/bias_forward_times.py --label direct 2>"$runs/times_direct.err" | grep "bias (1,N" | tee -a "$out/times.log"
echo "$(elapsed)"
NCU=(/usr/local/cuda/bin/ncu --clock-control none -c 1 --section SpeedOfLight --section SchedulerStats --section WarpStateStats
     --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --metrics 'regex:smsp__warp_issue_stalled_.*_per_warp_active\.pct|sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active|sm__inst_executed_pipe_.*sum|l1tex__data_bank_conflicts_pipe_lsu.*sum|smsp__inst_executed_op_ldsm.sum|local_.*sum')
profile() {  # $1: output name, $2: kernel regex, the rest: profile_attention.py's arguments
  local name=$1 regex=$2; shift 2
  (( $(left) > 80 )) || return 0
  JAX_FLASH_CUDA_LOGIT_ARRAYS=on timeout -s KILL 75 "${NCU[@]}" -k regex:"$regex" python3 .ci/gpu/profile_attention.py "$@" >"$runs/ncu_$name.txt" 2>&1
  echo "ncu $name: $(grep -c 'Duration' "$runs/ncu_$name.txt") kernel(s) $(elapsed)"
}
profile fwd_bias_ours 'flash_fwd' --forward-only --bias
profile fwd_plain_ours 'flash_fwd' --forward-only
profile fwd_bias_cudnn '(?i)(sdpa|fmha|flash|attn|fprop)' --forward-only --bias --peer cudnn
for f in "$runs"/ncu_*.txt; do
  echo "== $f"
  grep -E "^  [a-zA-Z_].*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|No Eligible|Registers Per|Achieved Occupancy|L2 Cache Throughput|DRAM Throughput|L2 Hit|stalled|pipe_|local_|bank_conflicts|ldsm|Local" "$f" \
    | awk '!/stalled/ || $NF+0 >= 2' | cut -c1-150 | head -80
done >"$out/ncu.log" 2>&1
tar czf "$out/gpu_runs.tgz" "$runs"; echo "== done $(elapsed)"
