#!/usr/bin/env bash
# Session 29 call 5 (the committed tree, d41854c's sources: the final defaults). The GPU tests
# without the kernel-choice subprocess runs (-n 14), as session 28's call 6 ran them; then the
# decode file by itself; then the head-dim-128 and 256 backward table (seq 4096 and 8192) with cuDNN
# and tokamax, the figures of record for this tree.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -1 "$out/build.log"
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short)
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 200 "${PT[@]}" -n 14 tests/test_cuda.py tests/test_cuda_ffi_validation.py \
  tests/test_alibi.py tests/test_softcap.py tests/test_segment_ids.py tests/test_cuda_block_sparse.py tests/test_sinks.py \
  tests/test_value_head_dim.py -k "not differential and not on_hopper and not on_cuda" >"$out/tests.log" 2>&1
echo "tests: $(tail -1 "$out/tests.log") $(elapsed)"; grep -E "^FAILED|^ERROR" "$out/tests.log" | head -20
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 120 "${PT[@]}" -n 14 tests/test_cuda_decode.py \
  -k "not differential and not on_hopper and not on_cuda" >"$out/decode_tests.log" 2>&1
echo "decode tests: $(tail -1 "$out/decode_tests.log") $(elapsed)"; grep -E "^FAILED|^ERROR" "$out/decode_tests.log" | head -10
source .ci/gpu/tokamax_peer.sh
timeout -s KILL 110 python3 -m jax_flash.benchmark --platform gpu --reps 5 --causal both --seqs 4096 8192 \
  --head-dims 128 256 --skip xla pallas 2>/dev/null | grep -v "unavailable: skipped" >"$out/table_hd128_256.md"
grep -E "^\| [0-9]" "$out/table_hd128_256.md" | grep -v "| fwd |"; echo "== done $(elapsed)"
