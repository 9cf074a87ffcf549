#!/usr/bin/env bash
# Session 28 call 6 (this tree: head dims 129..192's Hopper backward on the split wgmma kernels of
# 256 by default, JAX_FLASH_CUDA_HD192_BWD=sm80 the mma.sync ones). The GPU tests without the
# kernel-choice subprocess runs (-n 14); the sm80 selections directly under the variable (what
# test_head_dims_to_192_backward_on_mma_sync_on_hopper runs); the head-dim-192 table with cuDNN
# and tokamax; issue 17's value-head-dim figure (192/128) with tokamax.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short)
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 130 "${PT[@]}" -n 14 tests/test_cuda.py tests/test_cuda_ffi_validation.py \
  tests/test_alibi.py tests/test_softcap.py tests/test_segment_ids.py tests/test_cuda_block_sparse.py tests/test_sinks.py \
  tests/test_value_head_dim.py -k "not differential and not on_hopper and not on_cuda" >"$out/tests.log" 2>&1
echo "tests: $(tail -1 "$out/tests.log") $(elapsed)"; grep -E "^FAILED|^ERROR" "$out/tests.log" | head -20
REF="(test_cuda_matches_reference or test_deterministic_matches_reference)"
JAX_FLASH_CUDA_HD192_BWD=sm80 XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 60 "${PT[@]}" -n 8 tests/test_cuda.py \
  -k "($REF and (h160 or h192)) or test_command_buffer_capture or test_jit_training_step_reduces_loss" >"$out/sm80.log" 2>&1
echo "hd192 sm80: $(tail -1 "$out/sm80.log") $(elapsed)"; grep -E "^FAILED|^E " "$out/sm80.log" | head -5
source .ci/gpu/tokamax_peer.sh
timeout -s KILL 110 python3 -m jax_flash.benchmark --platform gpu --reps 5 --causal both --seqs 2048 4096 8192 \
  --head-dims 192 --skip xla pallas 2>/dev/null | grep -v "unavailable: skipped" >"$out/table_hd192.md"
grep -E "^\| [0-9]" "$out/table_hd192.md"; echo "== table $(elapsed)"
timeout -s KILL 100 python3 -m jax_flash.benchmark --platform gpu --reps 5 --seqs 4096 8192 --head-dims 192 \
  --value-head-dim 128 --skip xla pallas 2>/dev/null >"$out/value_head_dim.md"
grep -E "^\| [0-9]" "$out/value_head_dim.md"; echo "== done $(elapsed)"
