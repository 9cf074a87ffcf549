#!/usr/bin/env bash
# One GPU-machine run: build the extension (CUDA kernels included), run the GPU tests, run the
# benchmark beside cuDNN / XLA / Pallas, and print the summary last. Results go to $OUT (the device
# tool's output folder) or ./gpu_out.
#   usage: bash .ci/gpu/check.sh [pytest-args...]      (BENCH_ARGS="--quick" to shorten, BENCH=0
#   to skip the benchmark, TESTS=0 to skip the tests, TEST_TIMEOUT=seconds to bound them)
#   SANITIZE=1  compute-sanitizer memcheck and racecheck on .ci/gpu/sanitize_cases.py's odd shapes
# tokamax joins the benchmark's peers where its wheels were carried in .whl/ (see below).
# Opt-in steps for the end-to-end measurements (each several minutes):
#   E2E=1   examples/train_lm.py --preset gpt2-small --compare jax_flash,xla,cudnn (issue 4)
#   RING=1  examples/bench_ring.py: ring scaling and longest sequence, all visible GPUs (issue 5)
#   PROFILE=1  Nsight Compute reports of the forward and backward kernels (PROFILE_CASES: the
#             .ci/gpu/profile_attention.py arguments of each case, ';'-separated; hd128 seq 4096
#             by default)
#   VARIANTS="JAX_FLASH_CUDA_FORWARD=sm80 JAX_FLASH_CUDA_BACKWARD=sm80"  the benchmark
#             (BENCH_ARGS) once more per kernel choice (an environment assignment each, see
#             cuda/gpu/kernel_choice.h), into $out/variant_<assignment>
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."  # the repository root: pip install -e ., tests/
out="${OUT:-gpu_out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s)

echo "== build" | tee "$out/build.log"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$out/build.log"
# The modules carried in build/prebuilt (.ci/gpu/prebuilt.sh) when they match this tree, else a build.
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -50 "$out/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"

source .ci/gpu/tokamax_peer.sh  # tokamax beside cuDNN where its wheels were carried in .whl/

if [[ "${PROFILE:-0}" == 1 ]]; then
  echo "== profile (ncu)"
  # One report per case (.ci/gpu/profile_attention.py arguments, ';'-separated): the forward,
  # main backward and dQ-convert kernels of one jitted forward+backward (delta is XLA's).
  IFS=';' read -ra cases <<<"${PROFILE_CASES:---seq 4096;--seq 4096 --causal}"
  for case in "${cases[@]}"; do
    name="ncu$(echo "$case" | tr -d ' -' | tr -c 'a-z0-9\n' _)"
    # shellcheck disable=SC2086
    ncu --clock-control none -k regex:'flash_' -c 3 --set full --import-source no -f -o "$out/$name" \
      python3 .ci/gpu/profile_attention.py $case >"$out/$name.log" 2>&1 || tail -20 "$out/$name.log"
    ncu --import "$out/$name.ncu-rep" --page details >"$out/$name.txt" 2>&1
    ncu --import "$out/$name.ncu-rep" --page raw --csv >"$out/$name.csv" 2>&1
    echo "-- $case"
    grep -E "^  [a-z_].*\(|Duration|Registers Per|Achieved Occupancy|Compute \(SM\) Throughput|Memory Throughput" \
      "$out/$name.txt"
  done
  echo "profile: $(( $(date +%s) - start )) s"
fi

if [[ "${SANITIZE:-0}" == 1 ]]; then
  # compute-sanitizer on small odd shapes (.ci/gpu/sanitize_cases.py): memcheck and racecheck;
  # SANITIZE_TOOLS overrides the list. A tool's findings end its log with an ERROR SUMMARY.
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
    echo "== compute-sanitizer $tool"
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" timeout "${SANITIZE_TIMEOUT:-240}" \
      /usr/local/cuda/bin/compute-sanitizer --tool "$tool" --target-processes all \
      python3 .ci/gpu/sanitize_cases.py >"$out/sanitize_$tool.log" 2>&1
    grep -E "^case|ERROR SUMMARY|RACECHECK SUMMARY" "$out/sanitize_$tool.log" | tail -8
  done
  # The CUDA handlers' error paths (operands and attributes the API never passes): no invalid
  # access before they refuse.
  echo "== compute-sanitizer memcheck: FFI error paths"
  timeout "${SANITIZE_TIMEOUT:-240}" /usr/local/cuda/bin/compute-sanitizer --tool memcheck \
    --target-processes all python3 -m pytest -q -m gpu tests/test_cuda_ffi_validation.py \
    -p no:cacheprovider >"$out/sanitize_ffi_errors.log" 2>&1
  grep -E "passed|failed|ERROR SUMMARY" "$out/sanitize_ffi_errors.log" | tail -3
  echo "sanitizer: $(( $(date +%s) - start )) s"
fi

tests_rc=0
if [[ "${TESTS:-1}" == 1 ]]; then
  echo "== GPU tests"
  # No XLA autotuning for the tests (compile time); the benchmark below keeps it (its XLA peers).
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
    timeout "${TEST_TIMEOUT:-3600}" python3 -m pytest -q -m gpu tests/test_wgmma_layout.py tests --maxfail=5 -p no:cacheprovider "$@" 2>&1 \
    | tee "$out/pytest_gpu.log" | tail -30
  tests_rc=${PIPESTATUS[0]}
  echo "tests: $(( $(date +%s) - start )) s"
fi

if [[ "${BENCH:-1}" == 1 ]]; then
  echo "== benchmark"
  python3 -m jax_flash.benchmark --platform gpu --out "$out" ${BENCH_ARGS:-} 2>"$out/bench_progress.log" \
    | tee "$out/bench.log"
fi
for variant in ${VARIANTS:-}; do
  echo "== benchmark with $variant"
  name="variant_${variant//=/_}"
  env "$variant" python3 -m jax_flash.benchmark --platform gpu --out "$out/$name" ${BENCH_ARGS:-} \
    2>"$out/${name}_progress.log" | tee "$out/$name.log"
done
if [[ "$tests_rc" != 0 ]]; then
  echo "GPU tests failed: skipping the end-to-end steps"
elif [[ "${E2E:-0}" == 1 ]]; then
  echo "== end-to-end training (gpt2-small, jax_flash vs xla vs cudnn)"
  python3 examples/train_lm.py --preset gpt2-small --compare jax_flash,xla,cudnn \
    --out "$out/e2e" ${E2E_ARGS:-} 2>&1 | tee "$out/e2e.log" | tail -15
fi
if [[ "${RING:-0}" == 1 ]]; then
  echo "== ring attention"
  python3 examples/bench_ring.py --out "$out/ring" ${RING_ARGS:-} 2>&1 | tee "$out/ring.log" | tail -20
fi
echo "total: $(( $(date +%s) - start )) s"
[[ "${TESTS:-1}" == 1 ]] && { echo "== GPU tests summary"; tail -3 "$out/pytest_gpu.log"; }
exit "$tests_rc"
