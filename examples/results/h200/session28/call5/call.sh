#!/usr/bin/env bash
# Session 28 call 5: JAX_FLASH_CUDA_HD192_BWD=padded (experimental): the Hopper backward of head
# dims 129..192 on the split wgmma kernels of 256 (TMA zero-fills columns 192..255) instead of
# the mma.sync kernels of 192. Its test selections run directly under the variable (what
# test_head_dims_to_192_backward_padded_to_256_on_hopper runs), the new cases (h160, h192 MQA,
# the soft cap at 192) by default; then the backward at head dim 192 by default and padded, each
# in its own process with cuDNN.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS=--xla_gpu_autotune_level=0
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -n 8)
REF="(test_cuda_matches_reference or test_deterministic_matches_reference)"
timeout -s KILL 60 "${PT[@]}" tests/test_cuda.py tests/test_softcap.py -k "($REF and (h160 or h192)) or (test_cuda_against_reference and h192)" >"$out/default.log" 2>&1
echo "default h160/h192: $(tail -1 "$out/default.log") $(elapsed)"; grep -E "^FAILED|^E " "$out/default.log" | head -5
JAX_FLASH_CUDA_HD192_BWD=padded timeout -s KILL 90 "${PT[@]}" tests/test_cuda.py \
  -k "($REF and (h160 or h192)) or test_command_buffer_capture or test_jit_training_step_reduces_loss" >"$out/padded.log" 2>&1
echo "padded: $(tail -1 "$out/padded.log") $(elapsed)"; grep -E "^FAILED|^E " "$out/padded.log" | head -5
JAX_FLASH_CUDA_HD192_BWD=padded timeout -s KILL 90 "${PT[@]}" tests/test_softcap.py tests/test_alibi.py tests/test_segment_ids.py \
  -k cuda >"$out/padded_general.log" 2>&1
echo "padded general: $(tail -1 "$out/padded_general.log") $(elapsed)"; grep -E "^FAILED|^E " "$out/padded_general.log" | head -5
B=(env -u XLA_FLAGS python3 -m jax_flash.benchmark --platform gpu --reps 5 --seqs 2048 4096 8192 --head-dims 192 --causal both --skip xla pallas tokamax)
{
  echo "### default (mma.sync)"; timeout -s KILL 80 "${B[@]}" 2>/dev/null
  echo "### padded"; JAX_FLASH_CUDA_HD192_BWD=padded timeout -s KILL 80 "${B[@]}" 2>/dev/null
} | grep -E "###|bwd" >"$out/bench.log"
cat "$out/bench.log"; echo "== done $(elapsed)"
