#!/usr/bin/env bash
# Session 40, call 3: what calls 1-2's timeline found outside the forward's key-block loop, cut:
# the epilogue (gpu/epilogue.cuh store_output: every row's sums and inverse first, then
# predicated stores in a loop per kind of o, each row's key-range test only where the block may
# hold rows without keys; it took ~2000 cycles a tile, ~6600 in a differentiated call's forward)
# and the tile's task (formed once by the producer and copied by the consumers through shared
# memory; ~800 cycles a tile). In order: the CUDA suite's main files and the arrays' and
# block-sparse GPU tests on this tree's modules, then the plain rows at seq 1024 and 4096, head dims 64
# and 128, of the committed modules (build/baseline, stamp 4bc0ea74: 969807a's kernels) and of this
# tree's, each in its own process beside cuDNN and tokamax; then, as time allows, the suite's
# cases under the mma.sync forward, the direct store and a CTA per tile.
#   run from the repository root on the GPU machine: bash examples/results/h200/session40/call3/call.sh
set -uo pipefail
# The modules travel xz-compressed (with the baseline and tokamax's wheels the carry is 64 MiB).
mkdir -p build/prebuilt && cp build/prebuilt_xz/STAMP build/prebuilt_xz/_native.cpython-312-x86_64-linux-gnu.so build/prebuilt/
xz -dc build/prebuilt_xz/_native_cuda.so.xz >build/prebuilt/_native_cuda.cpython-312-x86_64-linux-gnu.so
source .ci/gpu/call_preamble.sh  # (step, bench)
XLA_FLAGS=--xla_gpu_autotune_level=0 step cuda_suite 200 "${PT[@]}" -n 14 tests/test_cuda.py \
  tests/test_cuda_ffi_validation.py tests/test_value_head_dim.py -k "not differential and not on_hopper and not on_cuda"
XLA_FLAGS=--xla_gpu_autotune_level=0 JAX_FLASH_CUDA_LOGIT_ARRAYS=on step array_tests 60 "${PT[@]}" -n 8 \
  tests/test_cuda_logit_arrays.py tests/test_cuda_block_sparse.py
base=/tmp/base; rm -rf $base; mkdir -p $base; cp -r jax_flash $base/
xz -dc build/baseline/_native_cuda.so.xz >$base/jax_flash/_native_cuda.cpython-312-x86_64-linux-gnu.so
cp build/baseline/_native.cpython-312-x86_64-linux-gnu.so $base/jax_flash/
B=(python3 -m jax_flash.benchmark --platform gpu --reps 5 --seqs 1024 4096 --head-dims 64 128 --causal both --skip xla pallas)
(cd $base && PYTHONPATH=$base:${PYTHONPATH:-} timeout -s KILL 130 "${B[@]}" --out "$OLDPWD/$runs/base" \
  2>"$OLDPWD/$runs/base_progress.log") >"$out/bench_base.md"
echo "== base $(elapsed)"; grep -E "^\| [0-9]" "$out/bench_base.md" | cut -c1-150
timeout -s KILL 130 "${B[@]}" --out "$runs/new" 2>"$runs/new_progress.log" >"$out/bench_new.md"
echo "== new $(elapsed)"; grep -E "^\| [0-9]" "$out/bench_new.md" | cut -c1-150
# The suite's cases under the other forwards that share the epilogue, as time allows.
XLA_FLAGS=--xla_gpu_autotune_level=0 step switch_tests 200 "${PT[@]}" -n 3 tests/test_cuda.py \
  -k "mma_sync_kernels_on_hopper or forward_direct_store_on_hopper or forward_on_a_cta_per_tile_on_hopper"
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
