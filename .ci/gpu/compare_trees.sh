#!/usr/bin/env bash
# One GPU-machine call that benchmarks two source trees, same shapes, same peers, one after the
# other: for a change that must leave the kernels' speed where it was (a restructuring), or to put
# a new kernel beside its predecessor. Each tree is built in place with CMake (nothing installed)
# and its own `python -m jax_flash.benchmark` is run from inside it.
#   mkdir .old_tree && git archive <commit> | tar -x -C .old_tree    (here; name it in `carry`)
#   OLD=.old_tree NEW=. BENCH_ARGS="--seqs 1024 4096 --head-dims 64 128 256 --skip xla pallas" \
#     bash .ci/gpu/compare_trees.sh
# Results: $OUT/old and $OUT/new (each the benchmark's results.json and table.md), and the logs.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out="$(mkdir -p "${OUT:-gpu_out}" && cd "${OUT:-gpu_out}" && pwd)"
args="${BENCH_ARGS:---seqs 1024 4096 --head-dims 64 128 256 --skip xla pallas}"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s)
elapsed() { echo "[$(( $(date +%s) - start )) s] $*"; }

for name in old new; do
  tree="${OLD:-.old_tree}"
  [[ "$name" == new ]] && tree="${NEW:-.}"
  elapsed "build $name ($tree)"
  cmake -G Ninja -S "$tree" -B "$tree/build/compare" -DJAX_FLASH_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
    -DPython_EXECUTABLE="$(command -v python3)" >"$out/${name}_build.log" 2>&1 &&
    ninja -C "$tree/build/compare" -j16 >>"$out/${name}_build.log" 2>&1 || { tail -30 "$out/${name}_build.log"; exit 1; }
  cp "$tree"/build/compare/_native*.so "$tree/jax_flash/"
  elapsed "benchmark $name"
  # shellcheck disable=SC2086
  (cd "$tree" && timeout "${BENCH_TIMEOUT:-300}" python3 -m jax_flash.benchmark --platform gpu --out "$out/$name" \
    $args 2>"$out/${name}_progress.log" | tee "$out/${name}_bench.log" | grep "^|")
done
elapsed "done"
