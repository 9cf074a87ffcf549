# Sourced first by a device call's script (from the repository root on the GPU machine, under
# `set -uo pipefail`): the folders that come back (`out`: $OUT, at most 8 files; `runs`: logs to
# tar into it), `elapsed` and `left` (seconds of the call's budget left, BUDGET_S or 570), the
# native modules (build/prebuilt when its stamp matches, else built here: .ci/gpu/prebuilt.sh),
# the GPU's name, tokamax as a peer where its wheels came (.ci/gpu/tokamax_peer.sh), and PT, the
# pytest command of the GPU tests.
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s)
elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
left() { echo $(( ${BUDGET_S:-570} - $(date +%s) + start )); }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -1 "$out/build.log"; echo "build $(elapsed)"; nvidia-smi --query-gpu=name --format=csv,noheader
source .ci/gpu/tokamax_peer.sh
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rs)
