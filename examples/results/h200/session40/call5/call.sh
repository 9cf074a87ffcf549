#!/usr/bin/env bash
# Session 40, call 5: v38's timeline showed the two consumer warpgroups issue their products back
# to back and then exponentiate together (the MUFU shared while the tensor cores idle). Here
# they may also take turns at the exponentials (JAX_FLASH_CUDA_FWD_SOFTMAX_TURNS=on, a run-time
# switch, off by default): the TILES timeline of both settings (the same debug build, where
# carried), the plain
# rows at seq 1024 and 4096 of both settings, each in its own process beside cuDNN and tokamax,
# then the switch's tests (the reference cases under it, the 640-tile forward, a misspelling).
#   run from the repository root on the GPU machine: bash examples/results/h200/session40/call5/call.sh
set -uo pipefail
mkdir -p build/prebuilt && cp build/prebuilt_xz/STAMP build/prebuilt_xz/_native.cpython-312-x86_64-linux-gnu.so build/prebuilt/
xz -dc build/prebuilt_xz/_native_cuda.so.xz >build/prebuilt/_native_cuda.cpython-312-x86_64-linux-gnu.so
source .ci/gpu/call_preamble.sh  # (step, bench)
if [[ -f build/timeline_TILES/_native_cuda.so.xz ]]; then
tl=/tmp/tl_TILES; rm -rf $tl; mkdir -p $tl; cp -r jax_flash $tl/
xz -dc build/timeline_TILES/_native_cuda.so.xz >$tl/jax_flash/_native_cuda.cpython-312-x86_64-linux-gnu.so
cp build/prebuilt/_native.cpython-312-x86_64-linux-gnu.so $tl/jax_flash/
script=$PWD/.ci/gpu/fwd_timeline.py
for turns in off on; do
  for shape in "--head-dim 64 --causal" "--head-dim 64" "--head-dim 64 --causal --seq 1024" "--head-dim 128 --causal"; do
    (cd $tl && JAX_FLASH_CUDA_FWD_SOFTMAX_TURNS=$turns PYTHONPATH=$tl timeout -s KILL 40 python3 "$script" \
      --out "$OLDPWD/$runs/TILES_$turns" $shape) >>"$out/timeline_$turns.md" 2>>"$runs/timeline_$turns.err"
  done
  echo "== timeline $turns $(elapsed)"; grep -E "^# |^cta0_wg0|^\| loop period" "$out/timeline_$turns.md" | cut -c1-160
done
fi
B=(python3 -m jax_flash.benchmark --platform gpu --reps 5 --seqs 1024 4096 --head-dims 64 128 --causal both --skip xla pallas)
for turns in off on; do
  JAX_FLASH_CUDA_FWD_SOFTMAX_TURNS=$turns timeout -s KILL 120 "${B[@]}" --out "$runs/bench_$turns" \
    2>"$runs/bench_${turns}_progress.log" >"$out/bench_$turns.md"
  echo "== bench $turns $(elapsed)"; grep -E "^\| [0-9]+ \| [0-9]+ \| [NY] \| (fwd|fwd\+bwd) " "$out/bench_$turns.md" | cut -c1-110
done
XLA_FLAGS=--xla_gpu_autotune_level=0 step switch_tests 150 "${PT[@]}" -n 2 tests/test_cuda.py \
  -k "forward_softmax_turns_on_hopper or (unknown_kernel_choice and SOFTMAX)"
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
