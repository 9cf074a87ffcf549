#!/usr/bin/env bash
# Session 32, call 2 (session 31's two calls in one): (1) the decode kernel's experimental L2
# hints (JAX_FLASH_CUDA_DECODE_LOADS=evict_first|prefetch256) through its GPU reference tests,
# then issue 15's B64 T1 and B16 T1 rows under plain / evict_first / prefetch256, alternated
# twice, cuDNN and XLA in every process. (2) Nsight Compute on issue 14's two rows furthest from
# cuDNN: head dim 64's causal forward at seq 2048 and head dim 256's backward at seq 4096, ours
# and cuDNN's kernels with the same sections.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -1 "$out/build.log"; echo "build $(elapsed)"

XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 150 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short \
  tests/test_cuda_decode.py -k "l2_hints or contiguous_matches or paged_matches" >"$out/decode_tests.log" 2>&1
echo "decode tests: $(tail -1 "$out/decode_tests.log") $(elapsed)"; grep -E "^FAILED|^E " "$out/decode_tests.log" | head -8

cases='B64 T1 32/8 S8192 hd128|B16 T1'
bench() {  # $1: label; the rest: environment
  local label=$1; shift
  env "$@" timeout -s KILL 60 python3 -m jax_flash.benchmark --platform gpu --preset decode --reps 10 \
    --skip pallas tokamax --cases "$cases" >"$runs/decode_$label.log" 2>&1
  echo "== $label $(elapsed)"; grep -E "^\| B" "$runs/decode_$label.log" | cut -c1-150
}
for round in 1 2; do
  bench "plain_r$round" JAX_FLASH_CUDA_DECODE_LOADS=plain
  bench "evict_first_r$round" JAX_FLASH_CUDA_DECODE_LOADS=evict_first
  bench "prefetch256_r$round" JAX_FLASH_CUDA_DECODE_LOADS=prefetch256
done 2>&1 | tee "$out/decode_bench.log"

NCU=(/usr/local/cuda/bin/ncu --clock-control none -c 1 --section SpeedOfLight --section SchedulerStats --section WarpStateStats
     --section MemoryWorkloadAnalysis --section Occupancy --metrics 'regex:smsp__warp_issue_stalled_.*_per_warp_active\.pct|sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active|lts__t_sectors_op_red.*sum|sm__inst_executed_pipe_.*sum')
profile() {  # $1: output name, $2: kernel regex, the rest: profile_attention.py's arguments
  local name=$1 regex=$2; shift 2
  timeout -s KILL 70 "${NCU[@]}" -k regex:"$regex" python3 .ci/gpu/profile_attention.py "$@" >"$runs/ncu_$name.txt" 2>&1
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
