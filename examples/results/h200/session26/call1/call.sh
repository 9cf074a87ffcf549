#!/usr/bin/env bash
# Session 26 call 1: dQ's accumulator in the quad order where the Hopper backward adds dQ by
# atomics (gpu/dq_accum_layout.cuh: one 16-byte red.global.add.v4.f32 per two 8-byte ones; head
# dims 64 and 256 by default). The backward-bearing GPU tests; memcheck on the split head dim 256
# case (11) and head dim 64's 128-row case (5), each its own process; the benchmark beside cuDNN
# for the committed build's modules (build/baseline) and this tree's, each in its own process.
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
B=(python3 -m jax_flash.benchmark --platform gpu --reps 5 --seqs 4096 8192 --head-dims 64 256 --causal both --skip xla pallas tokamax)
{
  echo "### baseline (committed modules)"
  (cd $base && PYTHONPATH=$base timeout -s KILL 120 "${B[@]}" --out "$OLDPWD/$runs/base" 2>"$OLDPWD/$runs/base_progress.log")
  echo "== base $(elapsed)"
  echo "### this tree"
  timeout -s KILL 120 "${B[@]}" --out "$runs/new" 2>"$runs/new_progress.log"
  echo "== new $(elapsed)"
} 2>&1 | grep -v "unavailable: skipped" >"$out/bench.log"
cat "$out/bench.log" | cut -c1-120
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short)
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 200 "${PT[@]}" -n 14 tests/test_cuda.py tests/test_cuda_ffi_validation.py \
  tests/test_alibi.py tests/test_softcap.py tests/test_segment_ids.py tests/test_cuda_block_sparse.py tests/test_sinks.py \
  -k "not differential and not on_hopper and not on_cuda" >"$out/tests.log" 2>&1
tail -2 "$out/tests.log"; grep -E "^FAILED|^ERROR" "$out/tests.log" | head -20; echo "== tests $(elapsed)"
CS=/usr/local/cuda/bin/compute-sanitizer
for c in 11 5; do
  timeout -s KILL 60 $CS --tool memcheck --print-limit 4 python3 .ci/gpu/sanitize_cases.py --cases $c >"$runs/memcheck_$c.log" 2>&1
  echo "case $c: $(grep -E "SUMMARY" "$runs/memcheck_$c.log")"; echo "== memcheck $c $(elapsed)"
done | tee "$out/memcheck.log"
NCU=(/usr/local/cuda/bin/ncu --clock-control none -c 2 --section SpeedOfLight --section SchedulerStats --section WarpStateStats
     --section MemoryWorkloadAnalysis --metrics 'regex:smsp__warp_issue_stalled_.*_per_warp_active\.pct|sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active|lts__t_requests_op_red.*sum|lts__t_sectors_op_red.*sum')
timeout -s KILL 90 "${NCU[@]}" -k regex:'flash_bwd_sm90' python3 .ci/gpu/profile_attention.py --seq 4096 --head-dim 256 >"$runs/ncu_bwd_hd256.txt" 2>&1
echo "== ncu ours $(elapsed)"
timeout -s KILL 90 "${NCU[@]}" -k regex:'sdpa|bprop|dgrad' python3 .ci/gpu/profile_attention.py --seq 4096 --head-dim 256 --peer cudnn >"$runs/ncu_bwd_hd256_cudnn.txt" 2>&1
echo "== ncu cudnn $(elapsed)"
for f in "$runs"/ncu_bwd_*.txt; do
  echo "== $f"
  grep -E "^  [a-z_]|Duration|Grid Size|Block Size|Compute \(SM\) Throughput|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Registers Per|DRAM Throughput|L2 Cache Throughput|Mem Busy|stalled|pipe_|lts__" "$f" \
    | awk '!/stalled/ || $NF+0 >= 2' | cut -c1-140 | head -60
done | tee "$out/ncu.log"
tar czf "$out/runs.tgz" "$runs"
echo "== done $(elapsed)"
