#!/usr/bin/env bash
# Session 35, call 2: a staged bias alone in the general kernels without the ids' code (forward:
# 0 B spilled instead of 576 at head dim 128): the arrays' GPU tests (the staged cases: the lean
# kernels, and beside a mask the ids' ones), the forward's times beside cuDNN and tokamax
# (call1/bias_forward_times.py), the benchmark's --bias rows, memcheck and racecheck on a bias
# alone.
#   run from the repository root on the GPU machine: bash examples/results/h200/session35/call2/call.sh
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
left() { echo $(( ${BUDGET_S:-560} - $(date +%s) + start )); }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -1 "$out/build.log"; echo "build $(elapsed)"; nvidia-smi --query-gpu=name --format=csv,noheader
source .ci/gpu/tokamax_peer.sh
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rs)
JAX_FLASH_CUDA_LOGIT_ARRAYS=on XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 150 "${PT[@]}" -n 8 \
  tests/test_cuda_logit_arrays.py -k "against_jax_nn and staged" >"$out/staged_tests.log" 2>&1
echo "staged cases: $(tail -1 "$out/staged_tests.log") $(elapsed)"
grep -E "^FAILED|^ERROR|^E " "$out/staged_tests.log" | head -30
JAX_FLASH_CUDA_LOGIT_ARRAYS=on timeout -s KILL 150 python3 examples/results/h200/session35/call1/bias_forward_times.py \
  --label staged --peers 2>"$runs/times.err" | tee "$out/times.log"
tail -2 "$runs/times.err" | cut -c1-300; echo "$(elapsed)"
if (( $(left) > 150 )); then
  JAX_FLASH_CUDA_LOGIT_ARRAYS=on timeout -s KILL 110 python3 -m jax_flash.benchmark --platform gpu --reps 5 --seqs 4096 \
    --causal both --head-dims 128 --skip xla pallas --bias --out "$runs/bias_bench" 2>"$runs/bias_bench_progress.log" >"$out/bias_bench.md"
  echo "== benchmark --bias $(elapsed)"; grep -E "^\| [0-9]" "$out/bias_bench.md" | cut -c1-200
fi
for tool in memcheck racecheck; do
  (( $(left) > 70 )) || break
  timeout -s KILL 60 /usr/local/cuda/bin/compute-sanitizer --tool $tool --print-limit 4 \
    python3 .ci/gpu/sanitize_cases.py --logit-arrays --bias-alone --cases 6 >"$runs/${tool}_bias_alone_6.log" 2>&1
  echo "$tool bias alone case 6: $(grep -E "^case|SUMMARY" "$runs/${tool}_bias_alone_6.log" | tr '\n' ' ') $(elapsed)"
  grep -E "Invalid|Error|Race|hazard" "$runs/${tool}_bias_alone_6.log" | head -4
done
if (( $(left) > 100 )); then
  JAX_FLASH_CUDA_LOGIT_ARRAYS=on XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL $(( $(left) - 15 )) "${PT[@]}" -n 8 \
    tests/test_cuda_logit_arrays.py -k "not under_the_switch and not staged" >"$out/other_tests.log" 2>&1
  echo "other array tests: $(tail -1 "$out/other_tests.log") $(elapsed)"; grep -E "^FAILED|^ERROR" "$out/other_tests.log" | head -20
fi
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
