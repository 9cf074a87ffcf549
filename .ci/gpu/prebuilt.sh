#!/usr/bin/env bash
# The native modules built on the development machine and carried to the GPU machine, so that a
# device call spends its time running, not compiling (a fresh GPU machine builds in 105-115 s;
# here the build is incremental: a changed kernel file recompiles alone).
#
#   bash .ci/gpu/prebuilt.sh build     # development machine: build for the GPU machine's
#                                      # Python 3.12 and jaxlib into build/dev312, copy the
#                                      # modules and their stamp to build/prebuilt/
#   source .ci/gpu/prebuilt.sh use     # GPU machine, from the repository root: put them in
#                                      # jax_flash/ and on PYTHONPATH if their stamp matches
#                                      # this tree and interpreter; else return 1 (then build)
#   source .ci/gpu/prebuilt.sh use-or-build LOG   # the GPU scripts' build step: `use`, else
#                                      # pip install -e . with the CUDA kernels (output to LOG)
#   bash .ci/gpu/prebuilt.sh pack      # development machine: build/prebuilt xz-compressed into
#                                      # build/prebuilt_xz (~8 MB instead of ~36), which `use`
#                                      # unpacks where build/prebuilt was not carried: a call
#                                      # then has room for a baseline and tokamax's wheels
#
# The device call names build/prebuilt in `carry` beside .whl. The stamp
# (.ci/gpu/native_stamp.py) hashes every source the build reads and the Python and jaxlib
# versions, so modules from another tree or interpreter are never used. PY312 names the
# development machine's Python 3.12 with jax/jaxlib of the GPU machine's version and nanobind
# (default /tmp/venv312/bin/python; pyenv's 3.12 is not on PATH there: `PYENV_VERSION=3.12.1
# python3.12 -m venv /tmp/venv312 && /tmp/venv312/bin/pip install jax==0.11.2 jaxlib==0.11.2
# nanobind`).
prebuilt_dir=build/prebuilt

prebuilt_build() {
  local py=${PY312:-/tmp/venv312/bin/python} build_dir=build/dev312
  mkdir -p build  # a fresh clone has none; the configure log goes beside the build folder
  if [[ ! -f $build_dir/build.ninja ]]; then
    cmake -S . -B "$build_dir" -G Ninja -DJAX_FLASH_CUDA=ON -DPython_EXECUTABLE="$py" \
      -DCMAKE_BUILD_TYPE=Release >"$build_dir.configure.log" 2>&1 || { tail -20 "$build_dir.configure.log"; return 1; }
  fi
  cmake --build "$build_dir" -j "$(nproc)" || return 1
  rm -rf "$prebuilt_dir" && mkdir -p "$prebuilt_dir"
  cp "$build_dir"/_native*.so "$prebuilt_dir"/ || return 1
  "$py" .ci/gpu/native_stamp.py >"$prebuilt_dir/STAMP" || return 1
  ls -la "$prebuilt_dir"
}

prebuilt_pack() {
  [[ -f $prebuilt_dir/STAMP ]] || { echo "prebuilt: nothing built to pack"; return 1; }
  rm -rf "$prebuilt_dir"_xz && mkdir -p "$prebuilt_dir"_xz
  cp "$prebuilt_dir"/STAMP "$prebuilt_dir"_xz/ || return 1
  for module in "$prebuilt_dir"/_native*.so; do
    xz -T0 -c "$module" >"$prebuilt_dir"_xz/"$(basename "$module")".xz || return 1
  done
  ls -la "$prebuilt_dir"_xz
}

prebuilt_use() {
  if [[ ! -f $prebuilt_dir/STAMP && -f ${prebuilt_dir}_xz/STAMP ]]; then
    mkdir -p "$prebuilt_dir" && cp "${prebuilt_dir}_xz/STAMP" "$prebuilt_dir"/ || return 1
    for packed in "${prebuilt_dir}"_xz/_native*.so.xz; do
      xz -dc "$packed" >"$prebuilt_dir/$(basename "$packed" .xz)" || return 1
    done
  fi
  [[ -f $prebuilt_dir/STAMP ]] || { echo "prebuilt: none carried"; return 1; }
  local here
  here=$(python3 .ci/gpu/native_stamp.py) || return 1
  if [[ $here != "$(cat "$prebuilt_dir/STAMP")" ]]; then
    echo "prebuilt: stamp differs from this tree's (stale modules): building instead"
    return 1
  fi
  cp "$prebuilt_dir"/_native*.so jax_flash/ || return 1
  # Modules that do not load here (another glibc, a driver too old for the CUDA runtime) are
  # removed and built instead.
  if ! python3 -c "import jax_flash._native, jax_flash._native_cuda" 2>&1; then
    echo "prebuilt: the modules do not load here: building instead"
    rm -f jax_flash/_native*.so
    return 1
  fi
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  echo "prebuilt: modules of stamp ${here:0:12} in jax_flash/"
}

prebuilt_use_or_build() {
  prebuilt_use && return 0
  JAX_FLASH_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16} python3 -m pip install \
    --no-build-isolation --no-deps -e . >>"$1" 2>&1
}

case "${1:-}" in
  build) prebuilt_build ;;
  pack) prebuilt_pack ;;
  use) prebuilt_use ;;
  use-or-build) prebuilt_use_or_build "${2:-/dev/null}" ;;
  *) echo "usage: bash .ci/gpu/prebuilt.sh build | pack | source .ci/gpu/prebuilt.sh use | use-or-build LOG" >&2; false ;;
esac
