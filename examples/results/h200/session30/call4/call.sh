#!/usr/bin/env bash
# Session 30 call 4 (the tree of call 3). The kernel-choice tests whose subprocesses run the
# forward's launch options (gpu/launch.cu sm90_fwd_options, moved out of launch_flash_fwd this
# session) and head dim 192's other backward kernels (whose dispatch the value head dim's
# touched), with their subprocess runs.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -1 "$out/build.log"
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rs)
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 400 "${PT[@]}" -n 8 tests/test_cuda.py \
  -k "test_forward_on_a or test_forward_alu_sums or test_forward_direct_store or test_forward_tile_choices or test_head_dims_to_192_backward_off_their_own_kernels_on_hopper" \
  >"$out/choice_tests.log" 2>&1
echo "kernel-choice tests: $(tail -1 "$out/choice_tests.log") $(elapsed)"; grep -E "^FAILED|^ERROR|^E " "$out/choice_tests.log" | head -20
echo "== done $(elapsed)"
