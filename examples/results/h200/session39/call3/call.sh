#!/usr/bin/env bash
# Session 39, call 3: why the FMA pipe's exponentials (call 2) bought nothing at head dim 64:
# Nsight Compute's pipe utilisation, issue and stall figures for the causal hd64 forward at seq
# 4096 under JAX_FLASH_CUDA_EXP2=mufu and fma8, and cuDNN's kernel on the same call; then the
# arrays' staged-bias cases under the producer's copies and the direct loads (what
# test_cuda_kernels_under_the_switch runs after call 1's default run), and a racecheck of an
# arrays case.
#   run from the repository root on the GPU machine: bash examples/results/h200/session39/call3/call.sh
set -uo pipefail
source .ci/gpu/call_preamble.sh  # (step, bench)
NCU=(/usr/local/cuda/bin/ncu --clock-control none -c 1 --section SpeedOfLight --section ComputeWorkloadAnalysis
     --section SchedulerStats --section WarpStateStats --section InstructionStats)
SHAPE=(--seq 4096 --head-dim 64 --causal --forward-only)
step ncu_fwd64_mufu 70 "${NCU[@]}" -k regex:flash_fwd python3 .ci/gpu/profile_attention.py "${SHAPE[@]}"
JAX_FLASH_CUDA_EXP2=fma8 step ncu_fwd64_fma8 70 "${NCU[@]}" -k regex:flash_fwd python3 .ci/gpu/profile_attention.py "${SHAPE[@]}"
step ncu_fwd64_cudnn 70 "${NCU[@]}" -k 'regex:(?i)(sdpa|fmha|flash|attn|fprop)' python3 .ci/gpu/profile_attention.py \
  "${SHAPE[@]}" --peer cudnn
for loads in staged direct; do
  JAX_FLASH_CUDA_LOGIT_ARRAYS=on JAX_FLASH_CUDA_BIAS_LOADS=$loads XLA_FLAGS=--xla_gpu_autotune_level=0 \
    step arrays_$loads 60 "${PT[@]}" -n 8 tests/test_cuda_logit_arrays.py -k "test_cuda_against_jax_nn and (staged or many-tiles)"
done
step racecheck_arrays 50 /usr/local/cuda/bin/compute-sanitizer --tool racecheck --print-limit 4 \
  python3 .ci/gpu/sanitize_cases.py --logit-arrays --cases 5
grep -E "^case|SUMMARY" "$out/racecheck_arrays.log" | head -4
echo "== done $(elapsed)"
