#!/usr/bin/env bash
# Session 27's GPU call (written in session 27, which had no device time: the next session's
# second call, after session 26's call 6). JAX_FLASH_CUDA_SM80_DQ=quads: the mma.sync backward on
# Hopper adds dQ in the accumulator's quad order by 16-byte atomics (cuda/gpu/dq_accum_layout.cuh).
# First its tests, each selection directly under the variables (never under -n 14 beside other
# processes: session 26's call 5); then the backward at head dim 192 (mma.sync by default on
# Hopper) with rows and with quads, each in its own process with cuDNN; then issue 17's value-head-
# dim figure (192/128, never run on a GPU) under both, tokamax in the same process.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS=--xla_gpu_autotune_level=0
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -n 8)
REF="(test_cuda_matches_reference or test_deterministic_matches_reference)"
JAX_FLASH_CUDA_SM80_DQ=quads timeout -s KILL 60 "${PT[@]}" tests/test_cuda.py -k "$REF and h192" \
  >"$out/quads_h192.log" 2>&1
echo "quads h192: $(tail -1 "$out/quads_h192.log") $(elapsed)"; grep -E "^FAILED|^E " "$out/quads_h192.log" | head -5
JAX_FLASH_CUDA_SM80_DQ=quads JAX_FLASH_CUDA_BACKWARD=sm80 timeout -s KILL 150 "${PT[@]}" tests/test_cuda.py \
  -k "($REF and (h32 or h40 or h64 or h80 or h96 or h111 or h128 or h256)) or test_command_buffer_capture or test_jit_training_step_reduces_loss" \
  >"$out/quads_sm80.log" 2>&1
echo "quads sm80: $(tail -1 "$out/quads_sm80.log") $(elapsed)"; grep -E "^FAILED|^E " "$out/quads_sm80.log" | head -5
JAX_FLASH_CUDA_SM80_DQ=quads JAX_FLASH_CUDA_BACKWARD=sm80 timeout -s KILL 90 "${PT[@]}" \
  tests/test_softcap.py tests/test_alibi.py tests/test_segment_ids.py -k cuda >"$out/quads_general.log" 2>&1
echo "quads general: $(tail -1 "$out/quads_general.log") $(elapsed)"; grep -E "^FAILED|^E " "$out/quads_general.log" | head -5
B=(env -u XLA_FLAGS python3 -m jax_flash.benchmark --platform gpu --reps 5 --seqs 4096 8192 --head-dims 192 --causal both --skip xla pallas tokamax)
{
  echo "### rows"; timeout -s KILL 60 "${B[@]}" 2>/dev/null
  echo "### quads"; JAX_FLASH_CUDA_SM80_DQ=quads timeout -s KILL 60 "${B[@]}" 2>/dev/null
} | grep -E "###|bwd" >"$out/quads_bench.log"
cat "$out/quads_bench.log"; echo "bench $(elapsed)"
source .ci/gpu/tokamax_peer.sh
V=(env -u XLA_FLAGS python3 -m jax_flash.benchmark --platform gpu --reps 5 --seqs 4096 8192 --head-dims 192 --value-head-dim 128 --skip xla pallas)
{
  echo "### rows"; timeout -s KILL 100 "${V[@]}" 2>/dev/null
  echo "### quads"; JAX_FLASH_CUDA_SM80_DQ=quads timeout -s KILL 100 "${V[@]}" 2>/dev/null
} >"$out/value_head_dim.md"
grep -E "###|^\| [0-9]" "$out/value_head_dim.md"; echo "== done $(elapsed)"
