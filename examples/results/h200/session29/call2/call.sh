#!/usr/bin/env bash
# Session 29 call 2 (this tree: head dims 129..192's Hopper backward on split wgmma kernels of
# their own, sm90/traits.cuh kSplitHeadDim at 192). The CUDA reference/deterministic cases of the
# head dims it serves and the split kernels' score-variant cases; JAX_FLASH_CUDA_HD192_BWD=padded
# and =sm80 selections directly under the variable; memcheck on the sanitizer's two new cases;
# the head-dim-192 table with cuDNN (and tokamax) under native and padded, and head dim 256 at
# seq 8192 (the split kernel's other head dim, whose code moved).
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -1 "$out/build.log"
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short)
REF="(test_cuda_matches_reference or test_deterministic_matches_reference)"
SEL="($REF and (h136 or h160 or h192 or h200 or h256)) or test_command_buffer_capture or test_jit_training_step_reduces_loss"
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 120 "${PT[@]}" -n 14 tests/test_cuda.py -k "$SEL" \
  >"$runs/native.log" 2>&1
echo "native: $(tail -1 "$runs/native.log") $(elapsed)"; grep -E "^FAILED|^E " "$runs/native.log" | head -8
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 120 "${PT[@]}" -n 14 tests/test_softcap.py tests/test_alibi.py \
  tests/test_segment_ids.py tests/test_value_head_dim.py tests/test_sinks.py -k "cuda" >"$runs/variants.log" 2>&1
echo "variants: $(tail -1 "$runs/variants.log") $(elapsed)"; grep -E "^FAILED|^E " "$runs/variants.log" | head -8
for v in padded sm80; do
  JAX_FLASH_CUDA_HD192_BWD=$v XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 90 "${PT[@]}" -n 8 tests/test_cuda.py \
    -k "$SEL" >"$runs/hd192_$v.log" 2>&1
  echo "HD192_BWD=$v: $(tail -1 "$runs/hd192_$v.log") $(elapsed)"; grep -E "^FAILED|^E " "$runs/hd192_$v.log" | head -5
done
for c in 14 15; do
  timeout -s KILL 80 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --print-limit 4 \
    python3 .ci/gpu/sanitize_cases.py --cases $c >"$runs/memcheck_$c.log" 2>&1
  echo "memcheck case $c: $(grep -E "SUMMARY" "$runs/memcheck_$c.log") $(elapsed)"
done
timeout -s KILL 100 /usr/local/cuda/bin/compute-sanitizer --tool racecheck --print-limit 4 \
  python3 .ci/gpu/sanitize_cases.py --cases 14 >"$runs/racecheck_14.log" 2>&1
echo "racecheck case 14: $(grep -E "SUMMARY" "$runs/racecheck_14.log") $(elapsed)"
source .ci/gpu/tokamax_peer.sh
for v in native padded; do
  JAX_FLASH_CUDA_HD192_BWD=$v timeout -s KILL 110 python3 -m jax_flash.benchmark --platform gpu --reps 5 --causal both \
    --seqs 2048 4096 8192 --head-dims 192 --skip xla pallas 2>/dev/null | grep -v "unavailable: skipped" >"$out/table_hd192_$v.md"
  echo "== HD192_BWD=$v $(elapsed)"; grep -E "^\| [0-9]" "$out/table_hd192_$v.md"
done
timeout -s KILL 80 python3 -m jax_flash.benchmark --platform gpu --reps 5 --causal both --seqs 8192 --head-dims 256 \
  --skip xla pallas tokamax 2>/dev/null | grep -v "unavailable: skipped" >"$runs/table_hd256.md"
echo "== hd256 $(elapsed)"; grep -E "^\| [0-9]" "$runs/table_hd256.md"
tar czf "$out/runs.tgz" "$runs"; echo "== done $(elapsed)"
