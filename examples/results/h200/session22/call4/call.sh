#!/usr/bin/env bash
# Session 22 call 4: sm90ws_deferdq (each visit's dQ during the next, no consumers' barrier):
# tests, sanitizer, A/B against the default at hd128 (cuDNN in each process); then issue 14's
# other rows: GQA 32/8 and MQA 16/1 (seq 4096, hd128, causal) and head dim 96 beside cuDNN and
# tokamax; end to end, examples/train_lm.py's GPT-2-small shape against cuDNN at seq 1024.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
source .ci/gpu/tokamax_peer.sh
head -2 "$out/build.log"; echo "== build $(elapsed)"
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short)
DEFER=JAX_FLASH_CUDA_BACKWARD=sm90ws_deferdq
env $DEFER XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 100 "${PT[@]}" -n 14 tests/test_cuda.py -k "((test_cuda_matches_reference or test_deterministic_matches_reference) and h128) or test_command_buffer_capture or test_jit_training_step_reduces_loss" >"$out/defer_tests.log" 2>&1
tail -2 "$out/defer_tests.log"; grep -E "^FAILED" "$out/defer_tests.log" | head -10; echo "== defer tests $(elapsed)"
{
  env $DEFER XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 60 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --target-processes all python3 .ci/gpu/sanitize_cases.py --cases 6,10 2>&1 | grep -E "^case|ERROR SUMMARY|Invalid|Error" | head -20
  env $DEFER XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 90 /usr/local/cuda/bin/compute-sanitizer --tool racecheck --target-processes all python3 .ci/gpu/sanitize_cases.py --cases 10 2>&1 | grep -E "^case|RACECHECK SUMMARY|ERROR SUMMARY|hazard" | head -20
} >"$out/sanitize.log" 2>&1
cat "$out/sanitize.log"; echo "== sanitize $(elapsed)"
B=(python3 -m jax_flash.benchmark --platform gpu --reps 5)
{
  for choice in default sm90ws_deferdq; do
    assignment=(); [[ $choice != default ]] && assignment=("JAX_FLASH_CUDA_BACKWARD=$choice")
    echo "### benchmark hd128, backward $choice (cuDNN in the same process)"
    env "${assignment[@]}" timeout 80 "${B[@]}" --seqs 4096 8192 --head-dims 128 --skip xla pallas tokamax --out "$runs/bwd_$choice" 2>"$runs/bwd_${choice}_progress.log"
    echo "== backward $choice $(elapsed)"
  done
  echo "### GQA 32/8, hd128, causal"
  timeout 70 "${B[@]}" --seqs 4096 --head-dims 128 --heads 32 --kv-heads 8 --causal yes --skip xla pallas --out "$runs/gqa" 2>"$runs/gqa_progress.log"
  echo "== gqa $(elapsed)"
  echo "### MQA 16/1, hd128, causal"
  timeout 70 "${B[@]}" --seqs 4096 --head-dims 128 --heads 16 --kv-heads 1 --causal yes --skip xla pallas --out "$runs/mqa" 2>"$runs/mqa_progress.log"
  echo "== mqa $(elapsed)"
  echo "### head dim 96, 20 heads, causal"
  timeout 70 "${B[@]}" --seqs 4096 --head-dims 96 --heads 20 --causal yes --skip xla pallas --out "$runs/hd96" 2>"$runs/hd96_progress.log"
  echo "== hd96 $(elapsed)"
} 2>&1 | tee "$out/bench.log"
tar czf "$out/runs.tgz" "$runs"
timeout 130 python3 examples/train_lm.py --preset gpt2-small --compare jax_flash,cudnn --steps 200 --out "$runs/e2e1024" >"$out/e2e.log" 2>&1
tail -8 "$out/e2e.log"; echo "== e2e 1024 $(elapsed)"
tar czf "$out/runs.tgz" "$runs"
