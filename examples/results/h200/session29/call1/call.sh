#!/usr/bin/env bash
# Written in session 28 for the next session (PERF_NOTES "Next GPU session" item 1): Nsight
# Compute on the split backward (head dim 256, seq 8192 causal, where sm90ws_stagedq measured +7%,
# and head dim 192 non-causal, where it measured -8%), the default (dQ by atomics) beside
# JAX_FLASH_CUDA_BACKWARD=sm90ws_stagedq, so that the stage's later release (the producer's loads
# waiting on the reductions' reads), the L2 reduction traffic and the tensor pipe can be compared;
# then the staged variant's whole GPU selection and memcheck on the split kernels' sanitizer case.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
NCU=(/usr/local/cuda/bin/ncu --clock-control none -c 1 --section SpeedOfLight --section SchedulerStats --section WarpStateStats
     --section MemoryWorkloadAnalysis --metrics 'regex:smsp__warp_issue_stalled_.*_per_warp_active\.pct|sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active|lts__t_requests_op_red.*sum|lts__t_sectors_op_red.*sum')
for v in sm90ws sm90ws_stagedq; do
  JAX_FLASH_CUDA_BACKWARD=$v timeout -s KILL 90 "${NCU[@]}" -k regex:'flash_bwd_sm90' python3 .ci/gpu/profile_attention.py \
    --seq 8192 --head-dim 256 --causal >"$runs/ncu_${v}_hd256_causal.txt" 2>&1
  JAX_FLASH_CUDA_BACKWARD=$v timeout -s KILL 90 "${NCU[@]}" -k regex:'flash_bwd_sm90' python3 .ci/gpu/profile_attention.py \
    --seq 8192 --head-dim 192 >"$runs/ncu_${v}_hd192.txt" 2>&1
  echo "== ncu $v $(elapsed)"
done
for f in "$runs"/ncu_*.txt; do
  echo "== $f"
  grep -E "Duration|Compute \(SM\) Throughput|Issue Slots Busy|No Eligible|Registers Per|L2 Cache Throughput|stalled|pipe_|lts__" "$f" \
    | awk '!/stalled/ || $NF+0 >= 2' | cut -c1-140 | head -40
done | tee "$out/ncu.log"
XLA_FLAGS=--xla_gpu_autotune_level=0 JAX_FLASH_CUDA_BACKWARD=sm90ws_stagedq timeout -s KILL 120 python3 -m pytest -q -m gpu \
  -p no:cacheprovider --tb=short -n 8 tests/test_cuda.py tests/test_softcap.py tests/test_alibi.py tests/test_segment_ids.py \
  -k "not differential and not on_hopper and not on_cuda" >"$out/stagedq_suite.log" 2>&1
echo "stagedq suite: $(tail -1 "$out/stagedq_suite.log") $(elapsed)"; grep -E "^FAILED|^E " "$out/stagedq_suite.log" | head -8
JAX_FLASH_CUDA_BACKWARD=sm90ws_stagedq timeout -s KILL 90 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --print-limit 4 \
  python3 .ci/gpu/sanitize_cases.py --cases 11 >"$runs/memcheck_stagedq_11.log" 2>&1
echo "memcheck stagedq case 11: $(grep -E "SUMMARY" "$runs/memcheck_stagedq_11.log") $(elapsed)"
tar czf "$out/runs.tgz" "$runs"; echo "== done $(elapsed)"
