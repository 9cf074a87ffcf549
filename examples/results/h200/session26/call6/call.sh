#!/usr/bin/env bash
# Session 26 call 6 (the committed build; the value-head-dim test given the forward's scheduler
# output that session 25 added): the kernel choices whose subprocess runs failed in call 5 (under
# -n 14 beside a dozen other processes, with no output kept), each selection run directly under
# its variable: sm90ws_atomicdq (dQ by atomics, the quad order at h64/h80/h96/h128) first. Then
# (PERF_NOTES next item 6) the backward with sm90ws_atomicdq beside the default at head dims 96
# and 128, each in its own process with cuDNN. Written in session 26, never run there (no device
# time left): the next session's first call.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS=--xla_gpu_autotune_level=0
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -n 8)
timeout -s KILL 40 "${PT[@]}" tests/test_value_head_dim.py -k test_cuda_handler_refuses_it >"$out/value_head_dim.log" 2>&1
echo "value_head_dim: $(tail -1 "$out/value_head_dim.log") $(elapsed)"
H="(h40 or h64 or h80 or h96 or h111 or h128)"
JAX_FLASH_CUDA_BACKWARD=sm90ws_atomicdq timeout -s KILL 100 "${PT[@]}" tests/test_cuda.py \
  -k "((test_cuda_matches_reference or test_deterministic_matches_reference) and $H) or test_command_buffer_capture or test_jit_training_step_reduces_loss" >"$out/atomicdq.log" 2>&1
echo "atomicdq: $(tail -1 "$out/atomicdq.log") $(elapsed)"; grep -E "^FAILED|^E " "$out/atomicdq.log" | head -5
JAX_FLASH_CUDA_FORWARD=sm90ws_dynamic timeout -s KILL 60 "${PT[@]}" tests/test_cuda.py \
  -k "(test_cuda_matches_reference and $H) or test_forward_only_matches_reference or test_command_buffer_capture" >"$out/dynamic.log" 2>&1
echo "dynamic: $(tail -1 "$out/dynamic.log") $(elapsed)"; grep -E "^FAILED|^E " "$out/dynamic.log" | head -5
JAX_FLASH_CUDA_FORWARD=sm90ws_grid timeout -s KILL 60 "${PT[@]}" tests/test_cuda.py \
  -k "(test_cuda_matches_reference and $H) or test_command_buffer_capture or test_jit_training_step_reduces_loss" >"$out/grid.log" 2>&1
echo "grid: $(tail -1 "$out/grid.log") $(elapsed)"; grep -E "^FAILED|^E " "$out/grid.log" | head -5
JAX_FLASH_CUDA_FORWARD=sm90ws_narrow timeout -s KILL 90 "${PT[@]}" tests/test_cuda.py \
  -k "(test_cuda_matches_reference and (h40 or h64 or h80 or h96 or h111 or h128 or h192 or h256)) or test_forward_splits_o_as_xla_would or test_command_buffer_capture or test_jit_training_step_reduces_loss" >"$out/narrow.log" 2>&1
echo "narrow: $(tail -1 "$out/narrow.log") $(elapsed)"; grep -E "^FAILED|^E " "$out/narrow.log" | head -5
B=(env -u XLA_FLAGS python3 -m jax_flash.benchmark --platform gpu --reps 5 --seqs 4096 8192 --head-dims 96 128 --causal both --skip xla pallas tokamax)
{
  echo "### default"; timeout -s KILL 90 "${B[@]}" 2>/dev/null
  echo "### sm90ws_atomicdq"; JAX_FLASH_CUDA_BACKWARD=sm90ws_atomicdq timeout -s KILL 90 "${B[@]}" 2>/dev/null
} | grep -E "###|bwd" >"$out/atomicdq_bench.log"
cat "$out/atomicdq_bench.log"; echo "== done $(elapsed)"
