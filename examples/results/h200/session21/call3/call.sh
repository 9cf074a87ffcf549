#!/usr/bin/env bash
# Session 21 call 2: measurements, every jax_flash row with a peer in the same process.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
source .ci/gpu/tokamax_peer.sh
head -3 "$out/build.log"; git log --oneline -1 2>/dev/null; echo "== build $(elapsed)"
export XLA_FLAGS=--xla_gpu_autotune_level=0
SEL="test_cuda_matches_reference and (t1000_s1100 or t333_s333)"
JAX_FLASH_CUDA_BACKWARD=sm90ws_m80 timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -n 4 tests/test_cuda.py -k "$SEL" >"$out/tests.log" 2>&1
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -n 4 tests/test_cuda.py -k "$SEL" >>"$out/tests.log" 2>&1
grep -E "passed|failed|FAILED" "$out/tests.log"; echo "== tests $(elapsed)"
unset XLA_FLAGS
{
  echo "### forward: default (TMA store) vs sm90ws_directstore, each process with cuDNN and tokamax"
  timeout 170 python3 .ci/gpu/forward_variants.py --variants default sm90ws_directstore --head-dims 64 128 --seqs 4096 8192 --reps 10 --out "$runs/forward" 2>"$runs/forward_progress.log"
  echo "== forward $(elapsed)"
  for choice in default sm90ws_m80; do
    skip="xla pallas"; assignment=()
    [[ $choice != default ]] && { skip="xla pallas tokamax"; assignment=("JAX_FLASH_CUDA_BACKWARD=$choice"); }
    echo "### benchmark, backward $choice (peers: cuDNN${assignment:+}$([[ $choice == default ]] && echo ', tokamax'))"
    env "${assignment[@]}" timeout 130 python3 -m jax_flash.benchmark --platform gpu --seqs 4096 8192 --head-dims 128 --reps 5 --skip $skip --out "$runs/bwd_$choice" 2>"$runs/bwd_${choice}_progress.log"
    echo "== backward $choice $(elapsed)"
  done
  for variant in "--logits-soft-cap 30" "--alibi"; do
    echo "### benchmark $variant, hd128 seq 4096 (cuDNN and tokamax where they take it)"
    # shellcheck disable=SC2086
    timeout 100 python3 -m jax_flash.benchmark --platform gpu --seqs 4096 --head-dims 128 --reps 5 --skip xla pallas $variant --out "$runs/variant_${variant//[ -]/}" 2>"$runs/variant_${variant//[ -]/}_progress.log"
    echo "== $variant $(elapsed)"
  done
} 2>&1 | tee "$out/bench.log"
tar czf "$out/runs.tgz" "$runs"
