#!/usr/bin/env bash
# PERF_NOTES "Next GPU session" item 3, no code: head dim 64's forward (causal at 0.78-0.90x the
# faster peer in session 26's table) on each tiling and tile order the kernel choice has: the
# default (128 x 128 tiles; causal calls dealt in static pairs), sm90ws_wide (192 query rows on
# three consumer warpgroups wherever they exist) and sm90ws_dynamic (the tile counter whatever the
# mask), each in its own process with cuDNN and tokamax, seq 1024-8192, causal and not. Written in
# session 27 (no device time), not yet run.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
source .ci/gpu/tokamax_peer.sh
timeout -s KILL 400 python3 .ci/gpu/forward_variants.py --reps 10 --variants default sm90ws_wide sm90ws_dynamic \
  --head-dims 64 --seqs 1024 2048 4096 8192 --out "$out/forward" 2>"$out/forward_progress.log"
echo "forward variants $(elapsed)"; tail -3 "$out/forward_progress.log"
tar -czf "$out/forward.tgz" -C "$out" forward 2>/dev/null; echo "== done $(elapsed)"
