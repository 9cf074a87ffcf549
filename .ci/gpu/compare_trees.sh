#!/usr/bin/env bash
# One GPU-machine call that benchmarks an older source tree and this one, same shapes, same peers:
# for a change that must leave the kernels' speed where it was (a restructuring), or to put a new
# kernel beside its predecessor. The older tree is built in place with CMake and measured first
# (nothing is installed yet), then this tree is installed editable and measured.
#   mkdir .old_tree && git archive <commit> | tar -x -C .old_tree    (here; name it in `carry`)
#   OLD=.old_tree BENCH_ARGS="--seqs 1024 4096 --head-dims 64 128 256 --skip xla pallas" \
#     bash .ci/gpu/compare_trees.sh
# Results: $OUT/old and $OUT/new (each the benchmark's results.json, table.md), and the logs.
set -uo pipefail
old="${OLD:-.old_tree}"
out="$(mkdir -p "${OUT:-gpu_out}" && cd "${OUT:-gpu_out}" && pwd)"
args="${BENCH_ARGS:---seqs 1024 4096 --head-dims 64 128 256 --skip xla pallas}"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s)
elapsed() { echo "[$(( $(date +%s) - start )) s] $*"; }

elapsed "build $old"
cmake -G Ninja -S "$old" -B "$old/build" -DJAX_FLASH_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
  -DPython_EXECUTABLE="$(command -v python3)" >"$out/old_build.log" 2>&1 &&
  ninja -C "$old/build" -j16 >>"$out/old_build.log" 2>&1 || { tail -30 "$out/old_build.log"; exit 1; }
cp "$old"/build/_native*.so "$old/jax_flash/"
elapsed "benchmark $old"
# shellcheck disable=SC2086
(cd "$old" && timeout "${BENCH_TIMEOUT:-300}" python3 -m jax_flash.benchmark --platform gpu --out "$out/old" $args \
  2>"$out/old_progress.log" | tee "$out/old_bench.log" | grep "^|")

elapsed "build this tree"
JAX_FLASH_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install --no-build-isolation --no-deps -e . \
  >"$out/new_build.log" 2>&1 || { tail -30 "$out/new_build.log"; exit 1; }
elapsed "benchmark this tree"
# shellcheck disable=SC2086
timeout "${BENCH_TIMEOUT:-300}" python3 -m jax_flash.benchmark --platform gpu --out "$out/new" $args \
  2>"$out/new_progress.log" | tee "$out/new_bench.log" | grep "^|"
elapsed "done"
