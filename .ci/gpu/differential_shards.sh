#!/usr/bin/env bash
# The differential run of tests/differential.py on the GPU in SHARDS parallel processes (most of
# its time is compiling, which one process does on one core): configurations 0..CONFIGS-1 of seed
# 0 split into contiguous ranges, each shard's log (every MISS as it happens, then its summary)
# in $OUT/diff<i>.log, then the MISS lines of all of them. Each shard stops at TIMEOUT seconds.
#   e.g. SHARDS=4 CONFIGS=300 TIMEOUT=300 IMPLEMENTATION=cuda bash .ci/gpu/differential_shards.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out="${OUT:-gpu_out}"
mkdir -p "$out"
shards=${SHARDS:-4} configs=${CONFIGS:-300}
per=$(( (configs + shards - 1) / shards ))
for (( i = 0; i < shards; ++i )); do
  first=$(( i * per )) last=$(( (i + 1) * per - 1 ))
  (( last >= configs )) && last=$(( configs - 1 ))
  (( first > last )) && continue
  # shellcheck disable=SC2046
  XLA_FLAGS="--xla_gpu_autotune_level=0" XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 \
    timeout "${TIMEOUT:-300}" python3 tests/differential.py --implementation "${IMPLEMENTATION:-cuda}" \
    --verbose --index $(seq "$first" "$last") >"$out/diff$i.log" 2>&1 &
done
wait
echo "== differential (${IMPLEMENTATION:-cuda}, configurations 0-$(( configs - 1 )), $shards shards)"
for (( i = 0; i < shards; ++i )); do
  [[ -f "$out/diff$i.log" ]] || continue
  echo "shard $i: $(grep -c '^-- ' "$out/diff$i.log") configurations done, $(grep -c '^MISS' "$out/diff$i.log") misses"
done
grep -h '^MISS' "$out"/diff*.log | cut -c1-300
