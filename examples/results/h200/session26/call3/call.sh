#!/usr/bin/env bash
# Session 26 call 3: the full table on the committed build (a076682: dQ's accumulator in the
# quad order): head dims 128, 64, 256; seq 1024 to 16384; causal and not; fwd, bwd, fwd+bwd and
# temp memory, cuDNN and tokamax (Mosaic GPU) in the same process, as far as the call's time goes.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
echo "== build $(elapsed)"
source .ci/gpu/tokamax_peer.sh
echo "== tokamax $(elapsed)"
timeout -s KILL $(( 540 - ($(date +%s) - start) )) python3 -m jax_flash.benchmark --platform gpu --reps 5 --causal both \
  --seqs 1024 2048 4096 8192 16384 --head-dims 128 64 256 --skip xla pallas --out "$runs/full" 2>"$runs/full_progress.log" >/dev/null
grep -v "Autotuning cache miss" "$runs/full_progress.log" >"$out/full_progress_short.log"
cp "$runs/full/table.md" "$out/full.md"; cp "$runs/full/results.json" "$out/full.json"
echo "== full $(elapsed)"
