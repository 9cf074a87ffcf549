#!/usr/bin/env bash
# Session 25 call 3: the Hopper forward's persistent CTAs take their tiles from a counter as they
# free (sm90/tile_scheduler.cuh kDynamic; the producer warp fetches each next tile a tile ahead
# and hands it to the consumers through shared memory), instead of the static paired deal
# (now JAX_FLASH_CUDA_FORWARD=sm90ws_static). The GPU suite's CUDA files and the static and
# per-tile grids' own test runs; memcheck and racecheck on the sanitizer cases; each forward
# choice beside cuDNN; Nsight Compute's spread of the SMs' active cycles.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -2 "$out/build.log"; echo "== build $(elapsed)"
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short)
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 200 "${PT[@]}" -n 14 tests/test_cuda.py tests/test_cuda_decode.py tests/test_cuda_ffi_validation.py \
  tests/test_alibi.py tests/test_softcap.py tests/test_segment_ids.py tests/test_cuda_block_sparse.py tests/test_sinks.py \
  tests/test_residual_precision.py -k "not differential and not on_hopper and not on_cuda" >"$out/tests.log" 2>&1
tail -2 "$out/tests.log"; grep -E "^FAILED|^ERROR" "$out/tests.log" | head -20; echo "== tests $(elapsed)"
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 150 "${PT[@]}" -n 2 tests/test_cuda.py \
  -k "static_persistent or cta_per_tile" >"$out/tests_grids.log" 2>&1
tail -2 "$out/tests_grids.log"; grep -E "^FAILED|^ERROR" "$out/tests_grids.log" | head; echo "== grid tests $(elapsed)"
CS=/usr/local/cuda/bin/compute-sanitizer
timeout 90 $CS --tool memcheck --target-processes all --print-limit 4 python3 .ci/gpu/sanitize_cases.py 2>&1 | cut -c1-300 | tail -5 >"$out/memcheck.log"
grep -E "SUMMARY|ERROR" "$out/memcheck.log" | head -3; echo "== memcheck $(elapsed)"
for c in 1 4; do
  timeout 60 $CS --tool racecheck --target-processes all --print-limit 4 python3 .ci/gpu/sanitize_cases.py --cases $c 2>&1 | cut -c1-300 | tail -4 >>"$out/racecheck.log"
done
grep -E "SUMMARY" "$out/racecheck.log"; echo "== racecheck $(elapsed)"
timeout 240 python3 .ci/gpu/forward_variants.py --reps 10 --variants default sm90ws_static sm90ws_grid --head-dims 64 128 256 \
  --seqs 1024 2048 4096 8192 --out "$runs/choices" 2>"$runs/choices_progress.log" | tee "$out/variants.log"
echo "== variants $(elapsed)"
NCU=(/usr/local/cuda/bin/ncu --clock-control none -k regex:'flash_fwd_sm90' -c 1
     --metrics 'sm__cycles_active.min,sm__cycles_active.avg,sm__cycles_active.max,sm__cycles_elapsed.max,gpu__time_duration.sum')
for choice in sm90ws sm90ws_static; do
  JAX_FLASH_CUDA_FORWARD=$choice timeout 50 "${NCU[@]}" python3 .ci/gpu/profile_attention.py --forward-only --seq 4096 --head-dim 64 \
    >"$runs/ncu_spread_$choice.txt" 2>&1
done
for f in "$runs"/ncu_spread_*.txt; do echo "== $f"; grep -E "sm__cycles|gpu__time" "$f"; done | tee "$out/ncu.log"
tar czf "$out/runs.tgz" "$runs"
echo "== done $(elapsed)"
