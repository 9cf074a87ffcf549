#!/usr/bin/env bash
# Session 40, call 1: the Hopper forward's per-block timeline (PERF_NOTES item 000). The modules of
# a debug build (-DJAX_FLASH_CUDA_TIMELINE=ON: sm90/fwd_timeline.h, built on the development
# machine into build/timeline, xz-compressed) run from a copy of the package; each shape in its
# own process, cuDNN's forward timed beside it (.ci/gpu/fwd_timeline.py).
#   run from the repository root on the GPU machine: bash examples/results/h200/session40/call1/call.sh
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
tl=/tmp/tl; rm -rf $tl; mkdir -p $tl; cp -r jax_flash $tl/
xz -dc build/timeline/_native_cuda.so.xz >$tl/jax_flash/_native_cuda.cpython-312-x86_64-linux-gnu.so
cp build/timeline/_native.cpython-312-x86_64-linux-gnu.so $tl/jax_flash/
script=$PWD/.ci/gpu/fwd_timeline.py
run() {
  local name=$1; shift
  (cd $tl && PYTHONPATH=$tl timeout -s KILL 60 python3 "$script" --out "$OLDPWD/$runs" "$@") >"$out/$name.md" 2>"$runs/$name.err"
  echo "== $name rc=$? $(elapsed)"; cat "$out/$name.md" | head -40; tail -3 "$runs/$name.err"
}
run hd64_causal --head-dim 64 --causal
run hd64_noncausal --head-dim 64
run hd64_causal_bwdfwd --head-dim 64 --causal --for-backward
run hd64_causal_1024 --head-dim 64 --causal --seq 1024
run hd128_causal --head-dim 128 --causal
run hd128_noncausal --head-dim 128
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
