#!/usr/bin/env bash
# Session 32, call 3: (1) call 1 again on the dropout bits' new layout (16-bit halves, one Philox
# call per eight decisions in both passes, the backward's lanes swapping halves by a shuffle;
# call 1 measured the 32-bit layout at 1.92x the plain fwd+bwd at hd128 seq 4096) and the
# mma.sync kernels' dropout (head dims up to 32, deterministic=True, the sm80 switches): the GPU
# tests with the switch on (as chosen, and all on mma.sync), memcheck and racecheck, the cost
# beside the plain kernel. (2) Call 2 (not
# run: no machine was lent then): the decode kernel's L2 hints, then Nsight Compute on issue 14's
# two rows furthest from cuDNN.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -1 "$out/build.log"; echo "build $(elapsed)"
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rs)
for kernels in chosen sm80; do
  env=(JAX_FLASH_CUDA_DROPOUT=on XLA_FLAGS=--xla_gpu_autotune_level=0)
  [[ $kernels == sm80 ]] && env+=(JAX_FLASH_CUDA_FORWARD=sm80 JAX_FLASH_CUDA_BACKWARD=sm80)
  env "${env[@]}" timeout -s KILL 150 "${PT[@]}" tests/test_dropout.py \
    -k "test_cuda_against_reference or test_cuda_each_element or test_cuda_with_the_soft_cap" >"$out/dropout_tests_$kernels.log" 2>&1
  echo "dropout tests ($kernels): $(tail -1 "$out/dropout_tests_$kernels.log") $(elapsed)"
  grep -E "^FAILED|^ERROR|^E " "$out/dropout_tests_$kernels.log" | head -20
done
timeout -s KILL 110 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --print-limit 4 \
  python3 .ci/gpu/sanitize_cases.py --dropout --cases 1,3,6,9,11,14 >"$runs/memcheck_dropout.log" 2>&1
echo "memcheck dropout: $(grep -E "^case|SUMMARY" "$runs/memcheck_dropout.log" | tr '\n' ' ') $(elapsed)"
grep -E "Invalid|Error" "$runs/memcheck_dropout.log" | head -8
for c in 6 3; do
  timeout -s KILL 90 /usr/local/cuda/bin/compute-sanitizer --tool racecheck --print-limit 4 \
    python3 .ci/gpu/sanitize_cases.py --dropout --cases $c >"$runs/racecheck_dropout_$c.log" 2>&1
  echo "racecheck dropout case $c: $(grep -E "^case|SUMMARY" "$runs/racecheck_dropout_$c.log" | tr '\n' ' ') $(elapsed)"
done
B=(python3 -m jax_flash.benchmark --platform gpu --reps 5 --seqs 4096 --causal both --skip xla pallas tokamax)
for hd in 128 64; do
  JAX_FLASH_CUDA_DROPOUT=on timeout -s KILL 100 "${B[@]}" --head-dims $hd --dropout-rate 0.1 --out "$runs/dropout_hd$hd" \
    2>"$runs/dropout_hd${hd}_progress.log" >"$runs/dropout_cost_hd$hd.md"
  echo "== dropout cost hd$hd $(elapsed)"; grep -E "^\| [0-9]" "$runs/dropout_cost_hd$hd.md" | cut -c1-220
  tail -3 "$runs/dropout_hd${hd}_progress.log"
done
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
