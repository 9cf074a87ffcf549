#!/usr/bin/env bash
# Session 23 call 2: head dims 65..96 on kernels of their own (JAX_FLASH_CUDA_HD96, default
# native) and the longest-first order in 32-bit arithmetic; the deterministic tests now pass
# deterministic=True through (attention_testing.run_jax_flash dropped it before). test_cuda.py
# (kernel-choice subprocess runs left out but the padded head dims'), the sanitizer on the
# head-dim-96 cases, then head dim 96 (20 heads) native against padded, cuDNN and tokamax beside.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
source .ci/gpu/tokamax_peer.sh
head -2 "$out/build.log"; echo "== build $(elapsed)"
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short)
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 220 "${PT[@]}" -n 14 tests/test_cuda.py \
  -k "not on_hopper and not on_cuda or test_head_dims_to_96_padded_to_128_on_cuda" >"$out/tests.log" 2>&1
tail -2 "$out/tests.log"; grep -E "^FAILED|^ERROR" "$out/tests.log" | head -20; echo "== tests $(elapsed)"
{
  timeout 60 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --target-processes all python3 .ci/gpu/sanitize_cases.py --cases 1,13 2>&1 | grep -E "^case|ERROR SUMMARY|Invalid|Error" | head -20
  timeout 90 /usr/local/cuda/bin/compute-sanitizer --tool racecheck --target-processes all python3 .ci/gpu/sanitize_cases.py --cases 13 2>&1 | grep -E "^case|RACECHECK SUMMARY|ERROR SUMMARY|hazard" | head -20
} >"$out/sanitize.log" 2>&1
cat "$out/sanitize.log"; echo "== sanitize $(elapsed)"
B=(python3 -m jax_flash.benchmark --platform gpu --reps 5)
{
  for hd96 in native padded; do
    echo "### head dim 96 ($hd96), 20 heads, seq 4096 8192 (cuDNN, tokamax beside)"
    env JAX_FLASH_CUDA_HD96=$hd96 timeout 100 "${B[@]}" --seqs 4096 8192 --head-dims 96 --heads 20 --skip xla pallas --out "$runs/hd96_$hd96" 2>"$runs/hd96_${hd96}_progress.log"
    echo "== hd96 $hd96 $(elapsed)"
  done
} 2>&1 | tee "$out/bench.log"
tar czf "$out/runs.tgz" "$runs"
echo "== done $(elapsed)"
