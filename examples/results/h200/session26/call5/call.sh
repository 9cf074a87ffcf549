#!/usr/bin/env bash
# Session 26 call 5 (the committed build): the GPU tests call 2 did not run (call 4's whole suite,
# run with tokamax on PYTHONPATH, reported one failure before the call's time ended and named
# none): every other file with the gpu marker, and test_cuda.py's kernel-choice subprocess runs,
# verbose so that a failure is named as it happens.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
echo "== build $(elapsed)"
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 330 python3 -m pytest -v -m gpu -p no:cacheprovider --tb=short -rfE -n 14 \
  tests/test_nan_propagation.py tests/test_cuda_decode.py tests/test_jax_nn_parity.py tests/test_paged_variants.py \
  tests/test_edge_inputs.py tests/test_value_head_dim.py tests/test_differential.py tests/test_wgmma_layout.py \
  tests/test_cuda.py -k "not (test_cuda.py and not (differential or on_hopper or on_cuda))" >"$out/suite.log" 2>&1
grep -E "FAILED|ERROR|passed|failed" "$out/suite.log" | tail -25; echo "== suite $(elapsed)"
