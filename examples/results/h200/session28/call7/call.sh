#!/usr/bin/env bash
# Session 28 call 7 (this session's last device seconds): JAX_FLASH_CUDA_BACKWARD=sm90ws_stagedq
# (experimental: the split kernels' dQ handed off through the stage's Q and dO tiles to bulk
# reductions, sm90/traits.cuh kStageDq), its reference cases at head dims 160-256 directly under
# the variable, then the backward at head dims 256 and 192, seq 8192, default and staged, each in
# its own process with cuDNN.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS=--xla_gpu_autotune_level=0
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -n 8)
REF="(test_cuda_matches_reference or test_deterministic_matches_reference)"
JAX_FLASH_CUDA_BACKWARD=sm90ws_stagedq timeout -s KILL 50 "${PT[@]}" tests/test_cuda.py tests/test_softcap.py \
  -k "($REF and (h160 or h192 or h200 or h256)) or test_command_buffer_capture or (test_cuda_against_reference and (h192 or h256))" \
  >"$out/stagedq_tests.log" 2>&1
echo "stagedq tests: $(tail -1 "$out/stagedq_tests.log") $(elapsed)"; grep -E "^FAILED|^E " "$out/stagedq_tests.log" | head -8
B=(env -u XLA_FLAGS python3 -m jax_flash.benchmark --platform gpu --reps 5 --seqs 8192 --head-dims 256 192 --causal both --skip xla pallas tokamax)
{
  echo "### default"; timeout -s KILL 50 "${B[@]}" 2>/dev/null
  echo "### sm90ws_stagedq"; JAX_FLASH_CUDA_BACKWARD=sm90ws_stagedq timeout -s KILL 50 "${B[@]}" 2>/dev/null
} | grep -E "###| bwd" >"$out/bench.log"
cat "$out/bench.log"; echo "== done $(elapsed)"
