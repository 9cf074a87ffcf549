#!/usr/bin/env bash
# A short GPU-machine run for kernel work: build, the wgmma layout check, then for each kernel
# choice (an environment assignment, or "default") the head-dim 64/128 reference cases and
# jax_flash beside cuDNN at seq 4096, head dim 128. Every step has a time limit, so a kernel that
# hangs costs minutes, not the call. Results go to $OUT (the device tool's output folder) or
# ./gpu_out; the full check (every test, every peer) stays .ci/gpu/check.sh.
#   usage: CHOICES="default JAX_FLASH_CUDA_FORWARD=sm80" bash .ci/gpu/kernel_choices.sh
#   (SELECT=... overrides the pytest -k selection, BENCH_ARGS=... the benchmark's arguments)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."  # the repository root: pip install -e ., tests/
out="${OUT:-gpu_out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s)
elapsed() { echo "[$(( $(date +%s) - start )) s]"; }

echo "== build"
# The modules carried in build/prebuilt (.ci/gpu/prebuilt.sh) when they match this tree, else a build.
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -50 "$out/build.log"; exit 1; }
elapsed

echo "== wgmma layout check"
timeout 180 python3 -m pytest -q -m gpu tests/test_wgmma_layout.py -p no:cacheprovider 2>&1 \
  | tail -5
elapsed

select="${SELECT:-test_cuda_matches_reference and (h64 or h128)}"
status=0
for choice in ${CHOICES:-default}; do
  name="${choice//=/_}"
  assignment=()
  [[ "$choice" != default ]] && assignment=("$choice")
  echo "== $choice: tests"
  env "${assignment[@]}" XLA_FLAGS="--xla_gpu_autotune_level=0" timeout "${TEST_TIMEOUT:-240}" \
    python3 -m pytest -q -m gpu tests/test_cuda.py -k "$select" --maxfail=3 -p no:cacheprovider \
    >"$out/tests_$name.log" 2>&1
  rc=$?
  tail -4 "$out/tests_$name.log"
  [[ $rc != 0 ]] && { echo "tests exit status $rc (124: timed out)"; status=1; }
  elapsed
  echo "== $choice: benchmark"
  env "${assignment[@]}" timeout "${BENCH_TIMEOUT:-150}" python3 -m jax_flash.benchmark \
    --platform gpu --out "$out/bench_$name" ${BENCH_ARGS:---seqs 4096 --head-dims 128 --skip xla pallas} \
    2>"$out/bench_${name}_progress.log" | grep "^|"
  elapsed
done
exit "$status"
