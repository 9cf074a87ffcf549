#!/usr/bin/env bash
# Session 40, call 6: call 5's switch (JAX_FLASH_CUDA_FWD_SOFTMAX_TURNS) in the TILES timeline
# build of the same tree, off and on (does the loop's period shorten, do the warpgroups
# alternate), then the seq-4096 rows off, on, off, on, each in its own process beside cuDNN
# and tokamax (call 5's single runs moved by up to 8%, cuDNN by up to 3%).
#   run from the repository root on the GPU machine: bash examples/results/h200/session40/call6/call.sh
set -uo pipefail
mkdir -p build/prebuilt && cp build/prebuilt_xz/STAMP build/prebuilt_xz/_native.cpython-312-x86_64-linux-gnu.so build/prebuilt/
xz -dc build/prebuilt_xz/_native_cuda.so.xz >build/prebuilt/_native_cuda.cpython-312-x86_64-linux-gnu.so
BUDGET_S=330 source .ci/gpu/call_preamble.sh  # (step, bench)
tl=/tmp/tl_TILES; rm -rf $tl; mkdir -p $tl; cp -r jax_flash $tl/
xz -dc build/timeline_TILES/_native_cuda.so.xz >$tl/jax_flash/_native_cuda.cpython-312-x86_64-linux-gnu.so
cp build/prebuilt/_native.cpython-312-x86_64-linux-gnu.so $tl/jax_flash/
script=$PWD/.ci/gpu/fwd_timeline.py
for turns in off on; do
  for shape in "--head-dim 64 --causal" "--head-dim 64" "--head-dim 128 --causal" "--head-dim 128"; do
    (cd $tl && JAX_FLASH_CUDA_FWD_SOFTMAX_TURNS=$turns PYTHONPATH=$tl timeout -s KILL 40 python3 "$script" \
      --out "$OLDPWD/$runs/TILES_$turns" $shape) >>"$out/timeline_$turns.md" 2>>"$runs/timeline_$turns.err"
  done
  echo "== timeline $turns $(elapsed)"; grep -E "^# |^\| loop period" "$out/timeline_$turns.md" | cut -c1-170
done
B=(python3 -m jax_flash.benchmark --platform gpu --reps 5 --seqs 4096 --head-dims 64 128 --causal both --skip xla pallas)
for run in off1 on1 off2 on2; do
  JAX_FLASH_CUDA_FWD_SOFTMAX_TURNS=${run%[12]} timeout -s KILL 60 "${B[@]}" --out "$runs/bench_$run" \
    2>"$runs/bench_${run}_progress.log" >"$out/bench_$run.md"
  echo "== bench $run $(elapsed)"; grep -E "^\| [0-9]+ \| [0-9]+ \| [NY] \| fwd " "$out/bench_$run.md" | cut -c1-100
done
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
