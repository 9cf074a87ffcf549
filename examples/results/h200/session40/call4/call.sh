#!/usr/bin/env bash
# Session 40, call 4: call 3 measured the epilogue's rewrite and the producer's tasks together
# against the committed modules: the forward within the spread at seq 4096 (hd64 causal +4%,
# cuDNN -2% in the same runs) but seq 1024 hd128 causal -17% and hd64 non-causal -7%. Here the
# tasks are a switch (JAX_FLASH_CUDA_FWD_TASKS=each, the default, or producer), so one build
# runs the epilogue alone and both: the plain rows at seq 1024 and 4096 of the committed modules
# (build/baseline), this tree's, and this tree's with the producer's tasks, each in its own
# process beside cuDNN and tokamax; first call 3's modules' timeline (TILES, both changes) at the
# shapes that lost; then the switch's test and its misspelling's.
#   run from the repository root on the GPU machine: bash examples/results/h200/session40/call4/call.sh
set -uo pipefail
mkdir -p build/prebuilt && cp build/prebuilt_xz/STAMP build/prebuilt_xz/_native.cpython-312-x86_64-linux-gnu.so build/prebuilt/
xz -dc build/prebuilt_xz/_native_cuda.so.xz >build/prebuilt/_native_cuda.cpython-312-x86_64-linux-gnu.so
source .ci/gpu/call_preamble.sh  # (step, bench)
tl=/tmp/tl_TILES; rm -rf $tl; mkdir -p $tl; cp -r jax_flash $tl/
xz -dc build/timeline_TILES/_native_cuda.so.xz >$tl/jax_flash/_native_cuda.cpython-312-x86_64-linux-gnu.so
cp build/prebuilt/_native.cpython-312-x86_64-linux-gnu.so $tl/jax_flash/
script=$PWD/.ci/gpu/fwd_timeline.py
for shape in "--head-dim 128 --causal --seq 1024" "--head-dim 64 --seq 1024" "--head-dim 64 --causal"; do
  (cd $tl && PYTHONPATH=$tl timeout -s KILL 40 python3 "$script" --out "$OLDPWD/$runs/TILES" $shape) >>"$out/timeline.md" 2>>"$runs/timeline.err"
done
echo "== timeline $(elapsed)"; grep -E "^# |^\| (loop converted->converted|store_synced|tile_ready->tile|store_end->tile_ready|tile->first_s) " "$out/timeline.md" | cut -c1-150
base=/tmp/base; rm -rf $base; mkdir -p $base; cp -r jax_flash $base/
xz -dc build/baseline/_native_cuda.so.xz >$base/jax_flash/_native_cuda.cpython-312-x86_64-linux-gnu.so
cp build/baseline/_native.cpython-312-x86_64-linux-gnu.so $base/jax_flash/
B=(python3 -m jax_flash.benchmark --platform gpu --reps 5 --seqs 1024 4096 --head-dims 64 128 --causal both --skip xla pallas)
(cd $base && PYTHONPATH=$base:${PYTHONPATH:-} timeout -s KILL 120 "${B[@]}" --out "$OLDPWD/$runs/base" \
  2>"$OLDPWD/$runs/base_progress.log") >"$out/bench_base.md"
echo "== base $(elapsed)"
timeout -s KILL 120 "${B[@]}" --out "$runs/each" 2>"$runs/each_progress.log" >"$out/bench_each.md"
echo "== each $(elapsed)"
JAX_FLASH_CUDA_FWD_TASKS=producer timeout -s KILL 120 "${B[@]}" --out "$runs/producer" 2>"$runs/producer_progress.log" \
  >"$out/bench_producer.md"
echo "== producer $(elapsed)"
for f in base each producer; do echo "-- $f"; grep -E "^\| [0-9]+ \| [0-9]+ \| [NY] \| (fwd|fwd\+bwd) " "$out/bench_$f.md" | cut -c1-110; done
XLA_FLAGS=--xla_gpu_autotune_level=0 step switch_tests 150 "${PT[@]}" -n 2 tests/test_cuda.py \
  -k "forward_tasks_from_the_producer_on_hopper or (unknown_kernel_choice and FWD_TASKS)"
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
