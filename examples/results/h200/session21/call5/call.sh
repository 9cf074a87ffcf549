#!/usr/bin/env bash
# Session 21 call 4: soft cap / ALiBi general kernels with the tensor-core sums and the TMA store.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
source .ci/gpu/tokamax_peer.sh
head -2 "$out/build.log"; echo "== build $(elapsed)"
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -n 14 \
  tests/test_softcap.py tests/test_alibi.py -k cuda >"$out/tests.log" 2>&1
grep -E "[0-9]+ (passed|failed)" "$out/tests.log" | tail -1; grep -E "^FAILED" "$out/tests.log" | head; echo "== tests $(elapsed)"
for variant in "--logits-soft-cap 30" "--alibi"; do
  # shellcheck disable=SC2086
  timeout 80 python3 -m jax_flash.benchmark --platform gpu --seqs 4096 --head-dims 128 --reps 5 --skip xla pallas $variant 2>/dev/null | tee -a "$out/bench.log"
  echo "== $variant $(elapsed)"
done
