#!/usr/bin/env bash
# Session 35, call 3: which of the arrays' GPU cases does not finish (session 34's and call 2's
# test runs stalled after 9-14 of them): each CUDA_BIAS_CASES case in a process of its own under a
# timeout, its forward and its gradients reported as they complete (probe_case.py); the two other
# GPU tests likewise; then the staged cases again under JAX_FLASH_CUDA_BIAS_LOADS=direct.
#   run from the repository root on the GPU machine: bash examples/results/h200/session35/call3/call.sh
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_FLASH_CUDA_LOGIT_ARRAYS=on
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -1 "$out/build.log"; echo "build $(elapsed)"; nvidia-smi --query-gpu=name --format=csv,noheader
here=examples/results/h200/session35/call3
cases=$(python3 -c "import sys; sys.path.insert(0, 'tests'); from test_cuda_logit_arrays import CUDA_BIAS_CASES as c; print(' '.join(c))")
probe() {  # $1: label, $2: case, $3: timeout
  timeout -s KILL "$3" python3 $here/probe_case.py "$2" >"$runs/probe_$1_$2.log" 2>&1
  echo "$1 $2 rc=$? $(grep -E 'done$' "$runs/probe_$1_$2.log" | sed 's/.*: //' | tr '\n' ' ')"
}
for c in $cases; do probe staged "$c" 100 & done
for t in test_cuda_row_the_mask_empties_gives_zero_and_nan_shows test_cuda_block_diagonal_mask_skips_blocks; do
  (timeout -s KILL 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_cuda_logit_arrays.py::$t \
    >"$runs/$t.log" 2>&1; echo "$t rc=$? $(tail -1 "$runs/$t.log")") &
done
wait
echo "wave 1 $(elapsed)"
for c in $cases; do
  [[ $c == staged-* ]] && JAX_FLASH_CUDA_BIAS_LOADS=direct probe direct "$c" 75 &
done
wait
echo "wave 2 $(elapsed)"
grep -l "Error\|error" "$runs"/probe_*.log | head; for f in "$runs"/probe_*.log; do grep -qE "Traceback|Error" "$f" && { echo "== $f"; tail -5 "$f"; }; done | head -60
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
