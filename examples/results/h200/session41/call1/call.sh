#!/usr/bin/env bash
# Session 41, call 1: the forward with each next tile's first S issued before this tile's epilogue
# (JAX_FLASH_CUDA_FORWARD=sm90ws_overlap, flash_fwd_ws_kernel.cuh kOverlapTiles; Q in two
# buffers) against this tree's default (its consumer loop restructured around the epilogue's
# two steps) and the committed modules (build/baseline), each in its own process beside cuDNN
# and tokamax at seq 1024 and 4096, hd 64 and 128; first the 640-tile forward under the switch
# (a hang there fails fast), last the CUDA suite's main files and the switch's own cases.
#   run from the repository root on the GPU machine: bash examples/results/h200/session41/call1/call.sh
set -uo pipefail
source .ci/gpu/call_preamble.sh  # (step, bench)
XLA_FLAGS=--xla_gpu_autotune_level=0 step many_tiles 90 "${PT[@]}" tests/test_cuda.py -k "test_forward_of_more_tiles_than_sms and overlap"
base=/tmp/base; bash .ci/gpu/package_copy.sh $base build/baseline
B=(python3 -m jax_flash.benchmark --platform gpu --reps 5 --seqs 1024 4096 --head-dims 64 128 --causal both --skip xla pallas)
(cd $base && PYTHONPATH=$base:${PYTHONPATH:-} timeout -s KILL 110 "${B[@]}" --out "$OLDPWD/$runs/base" \
  2>"$OLDPWD/$runs/base_progress.log") >"$out/bench_base.md"
echo "== base $(elapsed)"
timeout -s KILL 110 "${B[@]}" --out "$runs/default" 2>"$runs/default_progress.log" >"$out/bench_default.md"
echo "== default $(elapsed)"
JAX_FLASH_CUDA_FORWARD=sm90ws_overlap timeout -s KILL 110 "${B[@]}" --out "$runs/overlap" \
  2>"$runs/overlap_progress.log" >"$out/bench_overlap.md"
echo "== overlap $(elapsed)"
for f in base default overlap; do echo "-- $f"; grep -E "^\| [0-9]+ \| [0-9]+ \| [NY] \| (fwd|fwd\+bwd) " "$out/bench_$f.md" | cut -c1-110; done
step suite 200 "${PT[@]}" -n 14 tests/test_cuda.py tests/test_cuda_ffi_validation.py tests/test_value_head_dim.py \
  -k "(not differential and not on_hopper and not on_cuda) or forward_overlapped_tiles_on_hopper"
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
