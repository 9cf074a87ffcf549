#!/usr/bin/env bash
# Session 54's call A, for the next session with device time (sessions 53 and 54 had none).
# Session 53's call A (the 16-byte O stores as the default and the epilogue's one per-row
# helper, named one by one; racecheck on two sanitize cases) with session 54's change to the
# CUDA dropout: the seeds' six words (common/dropout_bits.h DropoutSeedWord: the Philox
# counter's row and column words of a kernel's first row and key, which context parallelism
# moves; gpu/dropout_fragments.h DropoutStream adds them to every call's counter). Its dropout
# GPU tests (a subprocess under JAX_FLASH_CUDA_DROPOUT=on), memcheck on the dropout sanitize
# cases, and the dropout's cost over the plain kernel at head dim 128 (v32: 1.50x fwd+bwd);
# then head dim 256's table on an H200 beside session 51's call A.
# Needs: this tree's modules (`bash .ci/gpu/prebuilt.sh build && bash .ci/gpu/prebuilt.sh
# pack`), carry ["build/prebuilt_xz", ".whl"]; run from the repository root on the GPU machine:
#   bash examples/results/h200/session54/callA/call.sh
export BUDGET_S=${BUDGET_S:-570}; set -uo pipefail; source .ci/gpu/call_preamble.sh
step main_selection 150 "${PT[@]}" -vv -n 10 -rf tests/test_cuda.py tests/test_nan_propagation.py -k "not on_hopper and not on_cuda"
step pair_stores 150 "${PT[@]}" -vv -n 2 -rf tests/test_cuda.py -k "test_forward_pair_stores_on_cuda or test_unknown_kernel_choice_is_an_error"
step dropout_tests 150 "${PT[@]}" -vv -n 4 -rf tests/test_dropout.py tests/test_dropout_bits.py
CS=/usr/local/cuda/bin/compute-sanitizer
# (case 2: head dim 256 causal with a window, a 33-row block; 17: value head dim 120 in a
# 128-column tile, so that a lane's 8 columns past the width are skipped)
for check in racecheck:2 racecheck:17 memcheck:2; do
  tool=${check%%:*} case=${check#*:}
  step ${tool}_$case 60 $CS --tool $tool --print-limit 4 python3 .ci/gpu/sanitize_cases.py --cases $case
  grep -E "SUMMARY" "$out/${tool}_$case.log"
done
step memcheck_dropout 90 $CS --tool memcheck --print-limit 4 python3 .ci/gpu/sanitize_cases.py --dropout --cases 6,11,14
grep -E "^case|SUMMARY" "$out/memcheck_dropout.log" | tr '\n' ' '; echo
(( $(left) > 90 )) && {
  JAX_FLASH_CUDA_DROPOUT=on timeout -s KILL 80 python3 -m jax_flash.benchmark --platform gpu --reps 5 --seqs 4096 \
    --causal both --skip xla pallas tokamax --head-dims 128 --dropout-rate 0.1 --out "$runs/dropout_cost" \
    2>"$runs/dropout_cost_progress.log" >"$out/dropout_cost.md"
  echo "== dropout cost $(elapsed)"; grep -E "^\| [0-9]" "$out/dropout_cost.md" | cut -c1-160; }
(( $(left) > 100 )) && {
  benchmark_to hd256_table "$out/hd256_table.md" $(( $(left) - 10 )) --seqs 1024 2048 4096 8192 16384 --head-dims 256 --causal both
  echo "== hd256_table $(elapsed)"; grep -E "^\| [0-9]" "$out/hd256_table.md" | cut -c1-200; }
mkdir -p "$runs/logs" && mv "$out"/*.log "$runs/logs"/ 2>/dev/null
tar -C "$runs" -czf "$out/gpu_runs.tgz" .
echo "== done $(elapsed)"
# Call B (a call of its own, ~300 s): the decode file, -vv:
#   step decode 280 "${PT[@]}" -vv -n 6 -rf tests/test_cuda_decode.py
