#!/usr/bin/env bash
# The package of an earlier commit with its native modules, built on the development machine for
# the GPU machine (Python 3.12, its jaxlib; sm_90a only, ~8 min on 2 cores), ready to carry and
# to run beside this tree in one device call (.ci/gpu/bench_trees.sh): DIR/jax_flash and
# DIR/COMMIT alone, both native modules xz-compressed (~5.5 MB; bench_trees.sh unpacks them).
# For bisecting a speed change commit by commit: nine or ten trees fit the carry's 64 MiB.
#   bash .ci/gpu/tree_at.sh COMMIT DIR     (DIR git-ignored: .old_tree, .new_tree, .trees/NAME)
set -euo pipefail
commit=$1 dir=$2
py=${PY312:-/tmp/venv312/bin/python}
rm -rf "$dir" && mkdir -p "$dir"
git archive "$commit" | tar -x -C "$dir"
rm -rf "$dir/examples/results"
# sm_90a only: the Hopper kernels are what such a comparison times.
sed -i 's/-gencode=arch=compute_80,code=sm_80 //' "$dir/cuda/gpu/cuda_build.cmake"
cmake -S "$dir" -B "$dir/build/t" -G Ninja -DJAX_FLASH_CUDA=ON -DPython_EXECUTABLE="$py" \
  -DCMAKE_BUILD_TYPE=Release >"$dir.build.log" 2>&1
cmake --build "$dir/build/t" -j "$(nproc)" >>"$dir.build.log" 2>&1 || { tail -20 "$dir.build.log"; exit 1; }
for module in "$dir"/build/t/_native*.so; do
  xz -T0 -c "$module" >"$dir/jax_flash/$(basename "$module").xz"
done
# The package is all a benchmark run needs.
find "$dir" -mindepth 1 -maxdepth 1 ! -name jax_flash -exec rm -rf {} +
git rev-parse --short "$commit" >"$dir/COMMIT"
du -sh "$dir"
