#!/usr/bin/env bash
# Session 31, call 1. (1) The decode kernel's experimental L2 hints (JAX_FLASH_CUDA_DECODE_LOADS:
# evict_first, prefetch256) through its GPU reference tests, then issue 15's decode rows timed
# under each (and under 2 key chunks), cuDNN and XLA in every process, the settings alternated
# twice. (2) Nsight Compute on the two rows of issue 14 furthest from cuDNN: head dim 64's causal
# forward at seq 2048 and head dim 256's backward at seq 4096, ours and cuDNN's kernels with the
# same sections, for the next sessions' work: moved to call 2 (this call builds on the device).
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -3 "$out/build.log"; echo "build $(elapsed)"

XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 200 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short \
  tests/test_cuda_decode.py -k "l2_hints or contiguous_matches or paged_matches" >"$out/decode_tests.log" 2>&1
echo "decode tests: $(tail -1 "$out/decode_tests.log") $(elapsed)"; grep -E "^FAILED|^E " "$out/decode_tests.log" | head -8

cases='B64 T1 32/8 S8192 hd128|B16 T1'
bench() {  # $1: label; the rest: environment
  local label=$1; shift
  env "$@" timeout -s KILL 100 python3 -m jax_flash.benchmark --platform gpu --preset decode --reps 10 \
    --skip pallas tokamax --cases "$cases" >"$runs/decode_$label.log" 2>&1
  echo "== $label $(elapsed)"; grep -E "^\| B" "$runs/decode_$label.log" | cut -c1-150
}
for round in 1 2; do
  bench "plain_r$round" JAX_FLASH_CUDA_DECODE_LOADS=plain
  bench "evict_first_r$round" JAX_FLASH_CUDA_DECODE_LOADS=evict_first
  bench "prefetch256_r$round" JAX_FLASH_CUDA_DECODE_LOADS=prefetch256
done 2>&1 | tee "$out/decode_bench.log"
bench splits2 JAX_FLASH_CUDA_DECODE_SPLITS=2 2>&1 | tee -a "$out/decode_bench.log"

tar czf "$out/runs.tgz" "$runs"; echo "== done $(elapsed)"
