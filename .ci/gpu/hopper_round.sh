#!/usr/bin/env bash
# One GPU-machine call for Hopper kernel work after check.sh ran the suite: build, the tests named
# in TESTS_K (a pytest -k expression over the GPU tests; none when empty), then the measurements
# of issue 14/15 with a peer in every run, each step under its own time limit:
#   - backward kernel choices (BWD_CHOICES, JAX_FLASH_CUDA_BACKWARD values or "default"): the
#     benchmark (fwd+bwd, BENCH_ARGS) beside cuDNN (tokamax too in the default run);
#   - forward kernel choices (FWD_CHOICES) through .ci/gpu/forward_variants.py (FWD_ARGS);
#   - the decode preset (cuDNN, XLA and the copy bandwidth in each run) per JAX_FLASH_CUDA_DECODE
#     value in DECODE_CHOICES (kernel, the default; tiled, split; DECODE_ARGS adds options,
#     split on spaces, e.g. "--cases B64");
#   - with GENERATE=1, issue 15's generation table (.ci/gpu/generate_table.sh: a small model
#     trained briefly, then examples/generate.py at batch 1 and 64 with jax_flash, xla and
#     cudnn), under GENERATE_TIMEOUT (150 s).
# Results go to $OUT (the device tool's output folder) or ./gpu_out.
#   e.g. TESTS_K="decode" BWD_CHOICES="default sm90ws_bulkdq" \
#        DECODE_CHOICES="tiled kernel" GENERATE=1 bash .ci/gpu/hopper_round.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out="${OUT:-gpu_out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s)
elapsed() { echo "[$(( $(date +%s) - start )) s]"; }

# The modules carried in build/prebuilt (.ci/gpu/prebuilt.sh) when they match this tree, else a build.
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -50 "$out/build.log"; exit 1; }
source .ci/gpu/tokamax_peer.sh  # tokamax beside cuDNN where its wheels were carried in .whl/
echo "== build $(elapsed)"

if [[ -n "${TESTS_K:-}" ]]; then
  XLA_FLAGS="--xla_gpu_autotune_level=0" timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -m gpu \
    tests -k "$TESTS_K" -n "${TEST_WORKERS:-4}" --tb=short -p no:cacheprovider >"$out/tests.log" 2>&1
  grep -E "passed|failed|FAILED|Error" "$out/tests.log" | tail -15
  echo "== tests $(elapsed)"
fi

bench_args=${BENCH_ARGS:---seqs 4096 16384 --head-dims 64 128 --reps 5}
for choice in ${BWD_CHOICES:-}; do
  skip="xla pallas tokamax"
  assignment=()
  if [[ "$choice" == default ]]; then skip="xla pallas"; else assignment=("JAX_FLASH_CUDA_BACKWARD=$choice"); fi
  # shellcheck disable=SC2086
  env "${assignment[@]}" timeout "${BENCH_TIMEOUT:-120}" python3 -m jax_flash.benchmark --platform gpu \
    $bench_args --skip $skip --out "$out/bwd_$choice" >"$out/bwd_$choice.log" 2>"$out/bwd_${choice}_progress.log"
  echo "== backward $choice $(elapsed)"; cat "$out/bwd_$choice.log"
done

if [[ -n "${FWD_CHOICES:-}" ]]; then
  # shellcheck disable=SC2086
  timeout "${FWD_TIMEOUT:-120}" python3 .ci/gpu/forward_variants.py --variants $FWD_CHOICES \
    ${FWD_ARGS:---head-dims 64 --seqs 1024 4096 16384 --reps 10} --out "$out/forward" 2>&1 | tail -20
  echo "== forward $(elapsed)"
fi

for choice in ${DECODE_CHOICES:-}; do
  # shellcheck disable=SC2086
  JAX_FLASH_CUDA_DECODE="$choice" timeout "${DECODE_TIMEOUT:-120}" python3 -m jax_flash.benchmark \
    --platform gpu --preset decode --reps 5 ${DECODE_ARGS:-} --out "$out/decode_$choice" \
    >"$out/decode_$choice.log" 2>&1
  echo "== decode ($choice) $(elapsed)"
  if grep -q '^| case ' "$out/decode_$choice.log"; then  # the table (stdout), printed at the end
    sed -n '/^copy bandwidth [0-9.]* GB/,$p' "$out/decode_$choice.log"
  else  # stopped before it: the progress lines
    tail -14 "$out/decode_$choice.log"
  fi
done

if [[ "${GENERATE:-0}" == 1 ]]; then
  OUT="$out" timeout "${GENERATE_TIMEOUT:-150}" bash .ci/gpu/generate_table.sh 2>&1
  status=$?
  echo "== generate (exit $status) $(elapsed)"
  if [[ $status != 0 ]]; then  # stopped (124: the time limit): how far each step got
    tail -5 "$out/generate/train.log" 2>/dev/null
    grep -E "^attention |^[0-9]+ prompts" "$out/generate/generate.log" 2>/dev/null | cut -c1-240
  fi
fi
