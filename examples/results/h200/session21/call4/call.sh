#!/usr/bin/env bash
# Session 21 call 3: the GPU suite's other files, then test_cuda.py's kernel-choice selections run
# directly under their environment variables (the subprocess tests' -k strings), -n 14 each.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS=--xla_gpu_autotune_level=0
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -2 "$out/build.log"; echo "== build $(elapsed)"
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -n 14)
ign=(); for f in test_cuda test_cuda_decode test_alibi test_softcap test_segment_ids test_cuda_block_sparse test_sinks; do ign+=(--ignore "tests/$f.py"); done
timeout 150 "${PT[@]}" tests "${ign[@]}" -k "not differential" >"$out/second_half.log" 2>&1
grep -E "passed|failed" "$out/second_half.log" | tail -1; grep -E "^FAILED" "$out/second_half.log" | head; echo "== second half $(elapsed)"
R="test_cuda_matches_reference"; D="test_deterministic_matches_reference"
CAP="test_command_buffer_capture"; TRAIN="test_jit_training_step_reduces_loss"
run() {  # name, env assignment(s)..., then -- selection [files...]
  local name=$1; shift; local envs=(); while [[ $1 != -- ]]; do envs+=("$1"); shift; done; shift
  local sel=$1; shift; local files=("${@:-tests/test_cuda.py}")
  env "${envs[@]}" timeout 90 "${PT[@]}" "${files[@]}" -k "$sel" >"$out/choice.tmp" 2>&1
  echo "$name: $(grep -E '[0-9]+ (passed|failed)' "$out/choice.tmp" | tail -1) $(elapsed)"
  grep -E "^FAILED" "$out/choice.tmp" | head -5
  { echo "### $name"; tail -3 "$out/choice.tmp"; } >>"$out/choices.log"
}
{
run sm80 JAX_FLASH_CUDA_FORWARD=sm80 JAX_FLASH_CUDA_BACKWARD=sm80 -- "(($R or $D) and (h64 or h128)) or test_forward_splits_o_as_xla_would"
run directstore JAX_FLASH_CUDA_FORWARD=sm90ws_directstore -- "test_forward_only_matches_reference or ($R and (h64 or h128)) or $CAP or test_cuda_is_default_on_gpu"
run grid JAX_FLASH_CUDA_FORWARD=sm90ws_grid -- "($R and (h40 or h64 or h80 or h96 or h111 or h128)) or $CAP or $TRAIN"
run alusums JAX_FLASH_CUDA_FORWARD=sm90ws_alusums -- "(($R or $D) and (h40 or h64 or h128)) or test_forward_splits_o_as_xla_would or $TRAIN"
run narrow JAX_FLASH_CUDA_FORWARD=sm90ws_narrow -- "($R and (h40 or h64 or h80 or h96 or h111 or h128 or h192 or h256)) or test_forward_splits_o_as_xla_would or $CAP or $TRAIN"
run wide JAX_FLASH_CUDA_FORWARD=sm90ws_wide -- "($R and (h40 or h64 or h80 or h96 or h111 or h128 or h192 or h256)) or test_forward_splits_o_as_xla_would or $CAP or $TRAIN"
run atomicdq JAX_FLASH_CUDA_BACKWARD=sm90ws_atomicdq -- "(($R or $D) and (h40 or h64 or h80 or h96 or h111 or h128)) or $CAP or $TRAIN"
run tileddq JAX_FLASH_CUDA_BACKWARD=sm90ws_tileddq -- "(($R or $D) and (h80 or h96 or h111)) or $CAP or $TRAIN"
run bulkdq JAX_FLASH_CUDA_BACKWARD=sm90ws_bulkdq -- "(($R or $D) and (h40 or h64 or h128)) or $CAP or $TRAIN"
run general_atomicdq JAX_FLASH_CUDA_BACKWARD=sm90ws_atomicdq -- "cuda and (h40 or h64)" tests/test_softcap.py tests/test_alibi.py tests/test_segment_ids.py
run narrow_off JAX_FLASH_CUDA_NARROW=off -- "$R"
run decode_split JAX_FLASH_CUDA_DECODE=split -- "$R"
} 2>&1 | tee "$out/choices_summary.log"
rm -f "$out/choice.tmp"
