#!/usr/bin/env bash
# Session 25 call 1: the Hopper backward stores dS^T (and head dim 256's P^T) with stmatrix, one
# instruction a 16 x 16 fragment instead of eight st.shared.b32, and leaves the softmax scale out
# of dS (dK takes it before its store, dQ in its convert kernel): a visit's SASS instructions
# hd128 794 -> 735, hd64 1395 -> 1280, hd256 1026 -> 989. The GPU suite's CUDA files; racecheck on case 13; the backward beside cuDNN for
# the committed build's modules (build/baseline) and this tree's, each in its own process; and
# Nsight Compute on the head dim 64 inference forward at seq 2048, 4096 and 8192 (its throughput
# jumps 20% from 4096 to 8192 where cuDNN's is flat).
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -2 "$out/build.log"; echo "== build $(elapsed)"
base=/tmp/base; rm -rf $base; mkdir -p $base; cp -r jax_flash $base/
xz -dc build/baseline/_native_cuda.so.xz >$base/jax_flash/_native_cuda.cpython-312-x86_64-linux-gnu.so
cp build/baseline/_native.cpython-312-x86_64-linux-gnu.so $base/jax_flash/
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short)
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 200 "${PT[@]}" -n 14 tests/test_cuda.py tests/test_cuda_ffi_validation.py \
  tests/test_alibi.py tests/test_softcap.py tests/test_segment_ids.py tests/test_cuda_block_sparse.py tests/test_sinks.py \
  -k "not differential and not on_hopper and not on_cuda" >"$out/tests.log" 2>&1
tail -2 "$out/tests.log"; grep -E "^FAILED|^ERROR" "$out/tests.log" | head -20; echo "== tests $(elapsed)"
RC=(/usr/local/cuda/bin/compute-sanitizer --tool racecheck --target-processes all --print-limit 4 python3 .ci/gpu/sanitize_cases.py --cases)
timeout 60 "${RC[@]}" 13 2>&1 | cut -c1-300 | head -30 >"$out/racecheck.log"
grep -E "SUMMARY" "$out/racecheck.log"; echo "== racecheck $(elapsed)"
B=(python3 -m jax_flash.benchmark --platform gpu --reps 5 --seqs 4096 8192 --head-dims 128 64 256 --causal both --skip xla pallas tokamax)
{
  echo "### baseline (committed modules)"
  (cd $base && PYTHONPATH=$base timeout 120 "${B[@]}" --out "$OLDPWD/$runs/base" 2>"$OLDPWD/$runs/base_progress.log")
  echo "== base $(elapsed)"
  echo "### this tree"
  timeout 120 "${B[@]}" --out "$runs/new" 2>"$runs/new_progress.log"
  echo "== new $(elapsed)"
} 2>&1 | grep -v "unavailable: skipped" | tee "$out/bench.log"
NCU=(/usr/local/cuda/bin/ncu --clock-control none -k regex:'flash_fwd_sm90|sdpa' -c 1 --section SpeedOfLight
     --section SchedulerStats --section WarpStateStats --section LaunchStats --section Occupancy
     --metrics 'regex:smsp__warp_issue_stalled_.*_per_warp_active\.pct|sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active')
for seq in 2048 4096 8192; do
  timeout 60 "${NCU[@]}" python3 .ci/gpu/profile_attention.py --forward-only --seq $seq --head-dim 64 >"$runs/ncu_hd64_$seq.txt" 2>&1
  echo "== ncu $seq $(elapsed)"
done
timeout 60 "${NCU[@]}" python3 .ci/gpu/profile_attention.py --forward-only --seq 4096 --head-dim 64 --peer cudnn >"$runs/ncu_hd64_4096_cudnn.txt" 2>&1
for f in "$runs"/ncu_hd64_*.txt; do
  echo "== $f"
  grep -E "Duration|Grid Size|Block Size|Compute \(SM\) Throughput|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Registers Per|Dynamic Shared|Waves Per SM|DRAM Throughput|L2 Cache Throughput|stalled|pipe_" "$f" \
    | awk '!/stalled/ || $NF+0 >= 2' | cut -c1-140 | head -40
done | tee "$out/ncu.log"
tar czf "$out/runs.tgz" "$runs"
echo "== done $(elapsed)"
