#!/usr/bin/env bash
# Session 25 call 4 (call 3 ran out of its 600 s in memcheck, whose process a plain timeout did
# not end): the forward's tile counter (default) beside the static paired deal
# (sm90ws_static) and cuDNN at head dims 64, 128, 256; one memcheck and one racecheck case, each
# killed at 60 s; the fwd+bwd benchmark beside cuDNN at seq 4096 and 8192.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -2 "$out/build.log"; echo "== build $(elapsed)"
timeout -s KILL 170 python3 .ci/gpu/forward_variants.py --reps 10 --variants default sm90ws_static --head-dims 64 128 256 \
  --seqs 1024 2048 4096 8192 --out "$runs/choices" >"$out/variants.log" 2>"$runs/choices_progress.log"
cat "$out/variants.log"; echo "== variants $(elapsed)"
CS=/usr/local/cuda/bin/compute-sanitizer
timeout -s KILL 60 $CS --tool racecheck --print-limit 4 python3 .ci/gpu/sanitize_cases.py --cases 1 >"$out/racecheck.log" 2>&1
grep -E "SUMMARY" "$out/racecheck.log"; echo "== racecheck $(elapsed)"
timeout -s KILL 60 $CS --tool memcheck --print-limit 4 python3 .ci/gpu/sanitize_cases.py --cases 4 >"$out/memcheck.log" 2>&1
grep -E "SUMMARY" "$out/memcheck.log"; echo "== memcheck $(elapsed)"
timeout -s KILL 100 python3 -m jax_flash.benchmark --platform gpu --reps 5 --seqs 4096 8192 --head-dims 128 64 --causal both \
  --skip xla pallas tokamax --out "$runs/bench" >"$out/bench.log" 2>"$runs/bench_progress.log"
grep -v "unavailable: skipped" "$out/bench.log"; echo "== bench $(elapsed)"
tar czf "$out/runs.tgz" "$runs"
echo "== done $(elapsed)"
