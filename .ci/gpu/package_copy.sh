#!/usr/bin/env bash
# A copy of this tree's Python package with other native modules, to time or trace them beside
# this tree's in one device call (the committed kernels as a baseline, a debug build's
# timeline): DIR/jax_flash gets jax_flash/ and the modules of MODULES, a folder holding
# _native_cuda (xz-compressed, `_native_cuda*.so.xz` as prebuilt.sh pack names it too, or the
# .so itself) and optionally `_native`'s .so (else this tree's, which must be there:
# .ci/gpu/prebuilt.sh use). Run the copy with
# `cd DIR && PYTHONPATH=DIR:$PYTHONPATH python3 ...` (so `import jax_flash` finds it first).
#   bash .ci/gpu/package_copy.sh DIR MODULES
set -euo pipefail
dir=$1 modules=$2
suffix=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
rm -rf "$dir" && mkdir -p "$dir" && cp -r jax_flash "$dir"/
packed=$(ls "$modules"/_native_cuda*.so.xz 2>/dev/null | head -1)
if [[ -n $packed ]]; then
  xz -dc "$packed" >"$dir/jax_flash/_native_cuda$suffix"
else
  cp "$modules/_native_cuda$suffix" "$dir/jax_flash/"
fi
if [[ -f $modules/_native$suffix ]]; then cp "$modules/_native$suffix" "$dir/jax_flash/"; fi
[[ -f $dir/jax_flash/_native$suffix ]] || { echo "package_copy: no _native$suffix in $modules or jax_flash/" >&2; exit 1; }
echo "package_copy: $dir/jax_flash with the modules of $modules"
