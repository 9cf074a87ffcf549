#!/usr/bin/env bash
# GPU machine: the benchmark from each of several packages carried beside this tree (made by
# .ci/gpu/tree_at.sh, or a package copy: .ci/gpu/package_copy.sh), one process each, in the order
# given, the same ARGS and the peers they name in each: a bisection of a speed change in one call.
#   bash .ci/gpu/bench_trees.sh DIR... -- BENCHMARK_ARGS...
# The tables one after another in $OUT/bench_trees.md (a call returns at most 8 files), each also
# in gpu_runs/bench_<COMMIT or DIR's name>.md, the runs' records in $OUT/gpu_runs.tgz;
# TREE_S (default 75) seconds at most a tree.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=$PWD/gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
dirs=()
while (( $# )) && [[ $1 != -- ]]; do dirs+=("$1"); shift; done
shift
nvidia-smi --query-gpu=name --format=csv,noheader
for dir in "${dirs[@]}"; do
  for packed in "$dir"/jax_flash/_native*.so.xz; do
    [[ -f $packed ]] && xz -dc "$packed" >"${packed%.xz}"
  done
  label=$(cat "$dir/COMMIT" 2>/dev/null || basename "$dir")${LABEL_SUFFIX:-}
  (cd "$dir" && PYTHONPATH=$PWD timeout -s KILL "${TREE_S:-75}" python3 -m jax_flash.benchmark "$@" \
    --out "$runs/$label" 2>"$runs/${label}_progress.log" >"$runs/bench_$label.md")
  { echo "## $label"; cat "$runs/bench_$label.md"; } >>"$out/bench_trees.md"
  echo "== $label $(elapsed)"; grep -E "^\| [0-9]" "$runs/bench_$label.md" | cut -c1-110
done
tar czf "$out/gpu_runs.tgz" -C "$(dirname "$runs")" "$(basename "$runs")"
echo "== done $(elapsed)"
