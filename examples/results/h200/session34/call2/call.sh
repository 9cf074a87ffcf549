#!/usr/bin/env bash
# Session 34, call 2: the bias staged through shared memory (a 16-bit bias's tiles copied by the
# producer warp a stage ahead, read by ldmatrix; JAX_FLASH_CUDA_BIAS_LOADS=staged, the default
# under JAX_FLASH_CUDA_LOGIT_ARRAYS=on) beside session 33's direct loads (=direct): the arrays'
# GPU tests (the staged cases under both), memcheck and racecheck on a staged case, then the
# (1, N, T, S) bias at seq 4096 hd128 under each, cuDNN and tokamax with the same bias in each
# process; the CUDA suite's main files while time is left (BUDGET_S, default 360 s: the session's
# device time was nearly spent on machines that did not start).
#   run from the repository root on the GPU machine: bash examples/results/h200/session34/call2/call.sh
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
left() { echo $(( ${BUDGET_S:-360} - $(date +%s) + start )); }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -1 "$out/build.log"; echo "build $(elapsed)"
source .ci/gpu/tokamax_peer.sh
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rs)
JAX_FLASH_CUDA_LOGIT_ARRAYS=on XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 120 "${PT[@]}" -n 8 \
  tests/test_cuda_logit_arrays.py -k "not under_the_switch" >"$out/logit_array_tests.log" 2>&1
echo "logit array tests (staged): $(tail -1 "$out/logit_array_tests.log") $(elapsed)"
grep -E "^FAILED|^ERROR|^E " "$out/logit_array_tests.log" | head -30
B=(python3 -m jax_flash.benchmark --platform gpu --reps 5 --seqs 4096 --causal both --head-dims 128 --skip xla pallas --bias)
for loads in staged direct; do
  (( $(left) > 100 )) || break
  JAX_FLASH_CUDA_LOGIT_ARRAYS=on JAX_FLASH_CUDA_BIAS_LOADS=$loads timeout -s KILL 110 "${B[@]}" --out "$runs/bias_$loads" \
    2>"$runs/bias_${loads}_progress.log" >"$out/bias_$loads.md"
  echo "== --bias, $loads loads $(elapsed)"; grep -E "^\| [0-9]" "$out/bias_$loads.md" | cut -c1-260
  tail -2 "$runs/bias_${loads}_progress.log"
done
if (( $(left) > 70 )); then
  JAX_FLASH_CUDA_LOGIT_ARRAYS=on JAX_FLASH_CUDA_BIAS_LOADS=direct XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 60 \
    "${PT[@]}" -n 8 tests/test_cuda_logit_arrays.py -k "against_jax_nn and staged" >"$out/logit_array_tests_direct.log" 2>&1
  echo "staged-bias cases, direct loads: $(tail -1 "$out/logit_array_tests_direct.log") $(elapsed)"
  grep -E "^FAILED|^ERROR|^E " "$out/logit_array_tests_direct.log" | head -10
fi
for tool in memcheck racecheck; do
  (( $(left) > 70 )) || break
  timeout -s KILL 60 /usr/local/cuda/bin/compute-sanitizer --tool $tool --print-limit 4 \
    python3 .ci/gpu/sanitize_cases.py --logit-arrays --cases 6 >"$runs/${tool}_arrays_6.log" 2>&1
  echo "$tool arrays case 6: $(grep -E "^case|SUMMARY" "$runs/${tool}_arrays_6.log" | tr '\n' ' ') $(elapsed)"
  grep -E "Invalid|Error|Race|hazard" "$runs/${tool}_arrays_6.log" | head -4
done
if (( $(left) > 100 )); then
  XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL $(( $(left) - 15 )) "${PT[@]}" -n 14 tests/test_cuda.py \
    tests/test_cuda_ffi_validation.py -k "not differential and not on_hopper and not on_cuda" >"$out/tests.log" 2>&1
  echo "cuda suite: $(tail -1 "$out/tests.log") $(elapsed)"; grep -E "^FAILED|^ERROR" "$out/tests.log" | head -20
fi
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
