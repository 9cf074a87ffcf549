#!/usr/bin/env bash
# Session 40, call 2: call 1's timeline again with the stamps split by level (sm90/fwd_timeline.h):
# TILES (the tiles' phases, the epilogue's and the hand-over's parts, each block's end only, so the
# loop runs nearly as built) and BLOCKS (every phase of every block, the softmax split at its mask
# and maxima). Each build's modules (development machine, xz) run from a copy of the package, a
# shape a process, cuDNN's forward timed beside it (.ci/gpu/fwd_timeline.py).
#   run from the repository root on the GPU machine: bash examples/results/h200/session40/call2/call.sh
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
script=$PWD/.ci/gpu/fwd_timeline.py
for level in ${LEVELS:-TILES BLOCKS}; do
  tl=/tmp/tl_$level; rm -rf $tl; mkdir -p $tl; cp -r jax_flash $tl/
  xz -dc build/timeline_$level/_native_cuda.so.xz >$tl/jax_flash/_native_cuda.cpython-312-x86_64-linux-gnu.so
  cp build/timeline_$level/_native.cpython-312-x86_64-linux-gnu.so $tl/jax_flash/
done
run() {
  local level=$1 name=$2; shift 2
  local tl=/tmp/tl_$level
  mkdir -p "$runs/$level"
  (cd $tl && PYTHONPATH=$tl timeout -s KILL 60 python3 "$script" --out "$OLDPWD/$runs/$level" "$@") \
    >>"$out/$level.md" 2>"$runs/$level/$name.err"
  echo "== $level $name rc=$? $(elapsed)"; tail -3 "$runs/$level/$name.err"
}
for level in ${LEVELS:-TILES BLOCKS}; do
  run $level hd64_causal --head-dim 64 --causal
  run $level hd64_causal_1024 --head-dim 64 --causal --seq 1024
  run $level hd64_causal_bwdfwd --head-dim 64 --causal --for-backward
  run $level hd64_noncausal --head-dim 64
  run $level hd128_causal --head-dim 128 --causal
done
grep -E "^# |^\| (loop converted->converted|loop period|store|tile|converted->store|first_s|.*->tile)" "$out/TILES.md" | cut -c1-160
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
