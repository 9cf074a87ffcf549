#!/usr/bin/env bash
# Session 32, call 1: the CUDA dropout written in session 31 (issue 17 item 4, experimental behind
# JAX_FLASH_CUDA_DROPOUT=on), first time on a GPU: its GPU tests in a process with the switch on,
# memcheck on five sanitizer cases with --dropout (one process) and racecheck on two (one each),
# then its cost: head dim 128 (and 64) at seq 4096, causal and not, rate 0.1 beside the plain
# kernel in the same process (cuDNN timed without dropout: it takes none).
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -1 "$out/build.log"; echo "build $(elapsed)"
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rs)
JAX_FLASH_CUDA_DROPOUT=on XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 150 "${PT[@]}" tests/test_dropout.py \
  -k "test_cuda_against_reference or test_cuda_each_element or test_cuda_with_the_soft_cap" >"$out/dropout_tests.log" 2>&1
echo "dropout tests: $(tail -1 "$out/dropout_tests.log") $(elapsed)"; grep -E "^FAILED|^ERROR|^E " "$out/dropout_tests.log" | head -30
timeout -s KILL 110 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --print-limit 4 \
  python3 .ci/gpu/sanitize_cases.py --dropout --cases 1,5,6,11,14 >"$runs/memcheck_dropout.log" 2>&1
echo "memcheck dropout: $(grep -E "^case|SUMMARY" "$runs/memcheck_dropout.log" | tr '\n' ' ') $(elapsed)"
grep -E "Invalid|Error" "$runs/memcheck_dropout.log" | head -8
for c in 6 11; do
  timeout -s KILL 90 /usr/local/cuda/bin/compute-sanitizer --tool racecheck --print-limit 4 \
    python3 .ci/gpu/sanitize_cases.py --dropout --cases $c >"$runs/racecheck_dropout_$c.log" 2>&1
  echo "racecheck dropout case $c: $(grep -E "^case|SUMMARY" "$runs/racecheck_dropout_$c.log" | tr '\n' ' ') $(elapsed)"
done
B=(python3 -m jax_flash.benchmark --platform gpu --reps 5 --seqs 4096 --causal both --skip xla pallas tokamax)
for hd in 128 64; do
  JAX_FLASH_CUDA_DROPOUT=on timeout -s KILL 100 "${B[@]}" --head-dims $hd --dropout-rate 0.1 --out "$runs/dropout_hd$hd" \
    2>"$runs/dropout_hd${hd}_progress.log" >"$out/dropout_cost_hd$hd.md"
  echo "== dropout cost hd$hd $(elapsed)"; grep -E "^\| [0-9]" "$out/dropout_cost_hd$hd.md" | cut -c1-220
  tail -3 "$runs/dropout_hd${hd}_progress.log"
done
tar czf "$out/runs.tgz" "$runs"
echo "== done $(elapsed)"
