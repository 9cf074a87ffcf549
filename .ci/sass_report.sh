#!/usr/bin/env bash
# The SASS of one CUDA kernel, compiled here for sm_90a (or ARCH), and its loops
# (.ci/sass_loops.py): what each loop executes, to count a change's instructions before spending
# device time on it (session 18: the wgmma descriptors, 153 -> 83 instructions a key block).
# cuobjdump comes from the nvidia-cuda-cuobjdump wheel (pip download; no CUDA toolkit needed),
# unpacked once into build/tools.
#   usage: bash .ci/sass_report.sh cuda/sm90/flash_fwd_ws.cu 'Sm90FwdWsTraitsILi128ELi128E.*bfloat16Lb0ELb0ELb0E' [--span]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source=$1 pattern=$2
shift 2
arch=${ARCH:-90a}
# A CUDA binary tool: on PATH, or unpacked once into build/tools from its nvidia-cuda-<name> wheel.
tool() {
  local name=$1 found
  found=$(command -v "$name" || find build/tools -name "$name" -type f 2>/dev/null | head -1)
  if [[ -z $found ]]; then
    mkdir -p build/tools
    python3 -m pip download -q --no-deps "nvidia-cuda-$name" -d build/tools
    python3 -m zipfile -e build/tools/nvidia_cuda_"$name"-*.whl build/tools
    found=$(find build/tools -name "$name" -type f | head -1)
  fi
  chmod +x "$found" 2>/dev/null || true
  echo "$found"
}
cuobjdump=${CUOBJDUMP:-$(tool cuobjdump)}
# cuobjdump -sass runs nvdisasm, found on PATH.
nvdisasm=$(tool nvdisasm)
PATH="$(cd "$(dirname "$nvdisasm")" && pwd):$PATH"
include=$(python3 -c "import jax; print(jax.ffi.include_dir())")
cubin=build/tools/$(basename "$source" .cu).sm_$arch.cubin
nvcc -O3 -std=c++17 --expt-relaxed-constexpr -DNDEBUG "-gencode=arch=compute_$arch,code=sm_$arch" -Icuda \
  -I"$include" -cubin -o "$cubin" "$source"
kernel=$("$cuobjdump" -symbols "$cubin" | grep -oE '_Z[A-Za-z0-9_]+' | grep -E "$pattern" | head -1)
[[ -n $kernel ]] || { echo "no kernel of $source matches $pattern" >&2; exit 1; }
echo "$kernel"
"$cuobjdump" -sass -fun "$kernel" "$cubin" >"$cubin.sass"
python3 .ci/sass_loops.py "$cubin.sass" "$@"
