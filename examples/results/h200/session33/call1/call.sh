#!/usr/bin/env bash
# Written in session 33 (no GPU lent), for the next GPU session: the first run of jax.nn's bias
# and mask arrays in the Hopper kernels (experimental, JAX_FLASH_CUDA_LOGIT_ARRAYS=on; issue 16
# item 3): their GPU tests and the CUDA FFI validation file, memcheck on the sanitizer's cases
# with the arrays (one case a process), then their time beside cuDNN's with the same arrays
# (issue 16: a (1, N, T, S) bias at seq 4096 hd128, fwd+bwd >= cuDNN's).
#   run from the repository root on the GPU machine: bash examples/results/h200/session33/call1/call.sh
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -1 "$out/build.log"; echo "build $(elapsed)"
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rs)
JAX_FLASH_CUDA_LOGIT_ARRAYS=on XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 240 "${PT[@]}" -n 4 \
  tests/test_cuda_logit_arrays.py tests/test_cuda_ffi_validation.py >"$out/logit_array_tests.log" 2>&1
echo "logit array tests: $(tail -1 "$out/logit_array_tests.log") $(elapsed)"
grep -E "^FAILED|^ERROR|^E " "$out/logit_array_tests.log" | head -30
for c in 1 4 5 6 11 16; do
  timeout -s KILL 60 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --print-limit 4 \
    python3 .ci/gpu/sanitize_cases.py --logit-arrays --cases $c >"$runs/memcheck_arrays_$c.log" 2>&1
  echo "memcheck arrays case $c: $(grep -E "^case|SUMMARY" "$runs/memcheck_arrays_$c.log" | tr '\n' ' ') $(elapsed)"
  grep -E "Invalid|Error" "$runs/memcheck_arrays_$c.log" | head -4
done
B=(python3 -m jax_flash.benchmark --platform gpu --reps 5 --seqs 4096 --causal both --head-dims 128 --skip xla pallas)
for v in --bias --mask; do
  JAX_FLASH_CUDA_LOGIT_ARRAYS=on timeout -s KILL 120 "${B[@]}" $v --out "$runs/arrays${v#--}" \
    2>"$runs/arrays${v#--}_progress.log" >"$runs/arrays${v#--}.md"
  echo "== $v $(elapsed)"; grep -E "^\| [0-9]" "$runs/arrays${v#--}.md" | cut -c1-240
  tail -3 "$runs/arrays${v#--}_progress.log"
done
tar czf "$out/gpu_runs.tgz" "$runs"
