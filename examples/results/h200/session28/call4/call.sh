#!/usr/bin/env bash
# Session 28 call 4 (this tree: the quad-order dQ the mma.sync backward's default on Hopper, head
# dims 65..96 adding dQ by atomics by default). The GPU tests without the kernel-choice subprocess
# runs (-n 14), then the mma.sync backward's quad-dQ selections run directly under
# JAX_FLASH_CUDA_BACKWARD=sm80 (what test_mma_sync_backward_adds_quad_dq_on_hopper runs), then the
# table: head dims 80, 96 and 192, seq 2048-8192, cuDNN and tokamax in the process; and head dim
# 96 with a soft cap (the general kernel) by default and under sm90ws_bulkdq (the old default).
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
echo "== build $(elapsed)"
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short)
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 200 "${PT[@]}" -n 14 tests/test_cuda.py tests/test_cuda_ffi_validation.py \
  tests/test_alibi.py tests/test_softcap.py tests/test_segment_ids.py tests/test_cuda_block_sparse.py tests/test_sinks.py \
  tests/test_value_head_dim.py -k "not differential and not on_hopper and not on_cuda" >"$out/tests.log" 2>&1
echo "tests: $(tail -1 "$out/tests.log") $(elapsed)"; grep -E "^FAILED|^ERROR" "$out/tests.log" | head -20
REF="(test_cuda_matches_reference or test_deterministic_matches_reference)"
JAX_FLASH_CUDA_BACKWARD=sm80 XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 120 "${PT[@]}" -n 8 tests/test_cuda.py \
  -k "($REF and (h32 or h40 or h64 or h80 or h96 or h111 or h128 or h256)) or test_command_buffer_capture or test_jit_training_step_reduces_loss" \
  >"$out/sm80_quads.log" 2>&1
echo "sm80 quads: $(tail -1 "$out/sm80_quads.log") $(elapsed)"; grep -E "^FAILED|^E " "$out/sm80_quads.log" | head -5
JAX_FLASH_CUDA_BACKWARD=sm80 XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 90 "${PT[@]}" -n 8 \
  tests/test_softcap.py tests/test_alibi.py tests/test_segment_ids.py -k cuda >"$out/sm80_quads_general.log" 2>&1
echo "sm80 quads general: $(tail -1 "$out/sm80_quads_general.log") $(elapsed)"; grep -E "^FAILED|^E " "$out/sm80_quads_general.log" | head -5
source .ci/gpu/tokamax_peer.sh
timeout -s KILL 200 python3 -m jax_flash.benchmark --platform gpu --reps 5 --causal both --seqs 2048 4096 8192 \
  --head-dims 80 96 192 --skip xla pallas --out "$out/table" 2>"$out/table_progress.log" | grep -v "unavailable: skipped" >"$out/table.md"
grep -E "bwd" "$out/table.md"; echo "== table $(elapsed)"
C=(python3 -m jax_flash.benchmark --platform gpu --reps 5 --causal both --seqs 4096 --head-dims 96 --logits-soft-cap 30 --skip xla pallas tokamax)
{
  echo "### default"; timeout -s KILL 60 "${C[@]}" 2>/dev/null
  echo "### sm90ws_bulkdq"; JAX_FLASH_CUDA_BACKWARD=sm90ws_bulkdq timeout -s KILL 60 "${C[@]}" 2>/dev/null
} | grep -E "###| bwd" >"$out/softcap_hd96.log"
cat "$out/softcap_hd96.log"; echo "== done $(elapsed)"
