#!/usr/bin/env bash
# Session 48, call C: the Hopper dropout forward's keep decisions made by the producer
# warpgroup's idle warps a stage ahead (JAX_FLASH_CUDA_DROPOUT_BITS=producer, experimental;
# cuda/PERF_NOTES.md v46): the dropout GPU tests under it, compute-sanitizer memcheck and
# racecheck under it, the unknown-value test, then the cost beside the plain kernel
# (`--dropout-rate 0.1`) at head dims 128 and 64, seq 4096, causal and not, inline then producer;
# last, the replaced layouts' case that ran out of memory in call "layouts", alone.
#   run from the repository root on the GPU machine: bash examples/results/h200/session48/callC/call.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-400} source .ci/gpu/call_preamble.sh  # (step)
DT=(tests/test_dropout.py -k "test_cuda_against_reference or test_cuda_each_element or test_cuda_with_the_soft_cap")
step dropout_tests_producer 120 env JAX_FLASH_CUDA_DROPOUT=on JAX_FLASH_CUDA_DROPOUT_BITS=producer "${PT[@]}" -n 8 "${DT[@]}"
step unknown_values 60 "${PT[@]}" -n 4 tests/test_cuda.py -k test_unknown_kernel_choice_is_an_error
CS=/usr/local/cuda/bin/compute-sanitizer
step memcheck_producer 90 env JAX_FLASH_CUDA_DROPOUT_BITS=producer $CS --tool memcheck --print-limit 4 \
  python3 .ci/gpu/sanitize_cases.py --dropout --cases 6,11,14
grep -E "^case|SUMMARY" "$out/memcheck_producer.log" | tr '\n' ' '; echo
step racecheck_producer 60 env JAX_FLASH_CUDA_DROPOUT_BITS=producer $CS --tool racecheck --print-limit 4 \
  python3 .ci/gpu/sanitize_cases.py --dropout --cases 6
grep -E "^case|SUMMARY" "$out/racecheck_producer.log" | tr '\n' ' '; echo
B=(python3 -m jax_flash.benchmark --platform gpu --reps 5 --seqs 4096 --causal both --skip xla pallas tokamax)
for hd in 128 64; do
  for bits in inline producer; do
    (( $(left) > 60 )) || { echo "== cost hd$hd $bits: skipped (time)"; continue; }
    JAX_FLASH_CUDA_DROPOUT=on JAX_FLASH_CUDA_DROPOUT_BITS=$bits timeout -s KILL 70 "${B[@]}" --head-dims $hd \
      --dropout-rate 0.1 --out "$runs/cost_hd${hd}_$bits" 2>"$runs/cost_hd${hd}_${bits}_progress.log" \
      >"$runs/cost_hd${hd}_$bits.md"
    echo "== dropout cost hd$hd $bits $(elapsed)"; grep -E "^\| [0-9]" "$runs/cost_hd${hd}_$bits.md" | cut -c1-120
  done
done
[[ ${OOM_CASE:-yes} == yes ]] && step layouts_start 150 "${PT[@]}" tests/test_cuda.py \
  -k "test_forward_query_tile_rows_on_hopper and None-start"
mkdir -p "$runs/logs" && mv "$out"/*.log "$runs/logs"/
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
