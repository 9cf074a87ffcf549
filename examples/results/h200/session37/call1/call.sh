#!/usr/bin/env bash
# Session 37, call 1: session 36's call 1 cut to what one short call can hold (the device lent
# none for most of the session): the CUDA suite's main files first (every call now carries the
# mask bits' operand and the handlers' MaskOperand), then the arrays' GPU tests whole under the
# TMA bias tiles (the turn barrier's fix: many-tile cases; the backward's TMA tiles; the mask's
# bits), the turns switch's tests, the forward's times and the --bias rows with cuDNN and
# tokamax, one memcheck.
#   run from the repository root on the GPU machine: bash examples/results/h200/session37/call1/call.sh
set -uo pipefail
source .ci/gpu/call_preamble.sh  # (step: as this script had it)
export XLA_FLAGS=--xla_gpu_autotune_level=0
step cuda_suite 150 "${PT[@]}" -n 14 tests/test_cuda.py tests/test_cuda_ffi_validation.py \
  -k "not differential and not on_hopper and not on_cuda"
JAX_FLASH_CUDA_LOGIT_ARRAYS=on step array_tests 150 "${PT[@]}" -n 8 tests/test_cuda_logit_arrays.py \
  -k "against_jax_nn or row_the_mask or block_diagonal"
step turns_tests 100 "${PT[@]}" -n 3 tests/test_cuda.py -k "more_tiles_than_sms or turns_across_tiles"
JAX_FLASH_CUDA_LOGIT_ARRAYS=on step times 90 python3 examples/results/h200/session35/call1/bias_forward_times.py \
  --label tma --peers
grep -vE "^(W|I)[0-9]" "$out/times.log" | tail -12
JAX_FLASH_CUDA_LOGIT_ARRAYS=on step bias_bench 100 python3 -m jax_flash.benchmark --platform gpu --reps 5 \
  --seqs 4096 --causal both --head-dims 128 --skip xla pallas --bias --out "$runs/bias_bench"
grep -E "^\| [0-9]" "$out/bias_bench.log" | cut -c1-220
step memcheck_tma 55 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --print-limit 4 \
  python3 .ci/gpu/sanitize_cases.py --logit-arrays --cases 1,5
grep -E "^case|SUMMARY" "$out/memcheck_tma.log" | head -6
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
