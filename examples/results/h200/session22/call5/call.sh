#!/usr/bin/env bash
# Session 22 call 5: end to end at seq 4096 (examples/train_lm.py's GPT-2-small shape, batch 4,
# against cuDNN) and head dim 192 (seq 4096) beside cuDNN and tokamax.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
source .ci/gpu/tokamax_peer.sh
head -2 "$out/build.log"; echo "== build $(elapsed)"
timeout 60 python3 -m jax_flash.benchmark --platform gpu --seqs 4096 --head-dims 192 --reps 5 --skip xla pallas --out "$runs/hd192" 2>"$runs/hd192_progress.log" | tee "$out/bench.log"
echo "== hd192 $(elapsed)"
timeout 130 python3 examples/train_lm.py --preset gpt2-small --compare jax_flash,cudnn --seq-len 4096 --batch-size 4 --steps 100 --out "$runs/e2e4096" >"$out/e2e.log" 2>&1
tail -8 "$out/e2e.log"; echo "== e2e 4096 $(elapsed)"
tar czf "$out/runs.tgz" "$runs"
