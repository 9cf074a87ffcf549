#!/usr/bin/env bash
# Session 26 call 4 (the committed build, a076682's kernels): end to end, examples/train_lm.py's
# GPT-2-small shape (head dim 64) against cuDNN at seq 1024 (batch 16) and seq 4096 (batch 4);
# MQA 16/1, GQA 32/8 (head dim 128) and head dim 96 (20 heads) at seq 4096, causal, beside cuDNN
# and tokamax; then the GPU suite (-m gpu), as far as the call's time goes.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
echo "== build $(elapsed)"
timeout -s KILL 130 python3 examples/train_lm.py --preset gpt2-small --compare jax_flash,cudnn --steps 200 --out "$runs/e2e1024" >"$out/e2e1024.log" 2>&1
grep -A4 "^| attention" "$out/e2e1024.log"; echo "== e2e 1024 $(elapsed)"
timeout -s KILL 130 python3 examples/train_lm.py --preset gpt2-small --compare jax_flash,cudnn --seq-len 4096 --batch-size 4 --steps 100 --out "$runs/e2e4096" >"$out/e2e4096.log" 2>&1
grep -A4 "^| attention" "$out/e2e4096.log"; echo "== e2e 4096 $(elapsed)"
source .ci/gpu/tokamax_peer.sh
G=(python3 -m jax_flash.benchmark --platform gpu --reps 5 --causal yes --seqs 4096 --skip xla pallas)
{
  echo "### MQA 16/1"; timeout -s KILL 60 "${G[@]}" --head-dims 128 --heads 16 --kv-heads 1 --out "$runs/mqa" 2>"$runs/mqa_progress.log"
  echo "== mqa $(elapsed)"
  echo "### GQA 32/8"; timeout -s KILL 60 "${G[@]}" --head-dims 128 --heads 32 --kv-heads 8 --out "$runs/gqa" 2>"$runs/gqa_progress.log"
  echo "== gqa $(elapsed)"
  echo "### head dim 96, 20 heads"; timeout -s KILL 60 "${G[@]}" --head-dims 96 --heads 20 --out "$runs/hd96" 2>"$runs/hd96_progress.log"
  echo "== hd96 $(elapsed)"
} 2>&1 | grep -v "unavailable: skipped\|grouped-query" >"$out/shapes.log"
cut -c1-160 "$out/shapes.log"
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL $(( 470 - ($(date +%s) - start) )) python3 -m pytest -q -m gpu \
  -p no:cacheprovider --tb=short -n 14 tests/ >"$out/suite.log" 2>&1
tail -2 "$out/suite.log"; grep -E "^FAILED|^ERROR" "$out/suite.log" | head -20; echo "== suite $(elapsed)"
tar czf "$out/runs.tgz" --exclude="*.png" --exclude="*.npz" --exclude="*checkpoint*" "$runs"
echo "== done $(elapsed)"
