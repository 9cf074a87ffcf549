#!/usr/bin/env bash
# Session 51, call B: head dim 256 on the default kernels of main (a7b8728), the forward back at
# a076682's ratios (v49): the timeline of its forward, then the forward's existing tile deals and tile widths at seq 1024-2048, each in its
# own process with cuDNN, to see whether any closes seq 1024 (0.83-0.89x cuDNN on an H100).
export BUDGET_S=${BUDGET_S:-330}; set -uo pipefail; source .ci/gpu/call_preamble.sh
# The TILES timeline (a debug build of this tree, -DJAX_FLASH_CUDA_TIMELINE=TILES, carried xz'd in
# build/timeline_TILES) of head dim 256's inference forward: where a tile's time goes at seq 1024
# against 4096 (.ci/gpu/fwd_timeline.py; cuDNN's forward timed beside it).
tl=/tmp/tl_TILES; rm -rf $tl; mkdir -p $tl; cp -r jax_flash $tl/
xz -dc build/timeline_TILES/_native_cuda.so.xz >$tl/jax_flash/_native_cuda.cpython-312-x86_64-linux-gnu.so
cp build/timeline_TILES/_native.cpython-312-x86_64-linux-gnu.so $tl/jax_flash/
for shape in "1024" "1024 --causal" "4096"; do
  name=tl_hd256_$(echo $shape | tr -d ' -')
  (cd $tl && PYTHONPATH=$tl timeout -s KILL 60 python3 "$OLDPWD/.ci/gpu/fwd_timeline.py" --out "$OLDPWD/$runs/$name" \
    --head-dim 256 --seq $shape) >>"$out/timeline.md" 2>"$runs/$name.err"
  echo "== $name rc=$? $(elapsed)"; tail -2 "$runs/$name.err"
done
grep -E "^# |^\| (loop period|store|tile|first_s|.*->tile)" "$out/timeline.md" | cut -c1-160
bench_variants 60 default=tree dynamic=JAX_FLASH_CUDA_FWD_GRID=dynamic per_tile=JAX_FLASH_CUDA_FWD_GRID=per_tile \
  narrow=JAX_FLASH_CUDA_FORWARD=sm90ws_narrow -- --seqs 1024 2048 --head-dims 256 --causal both --skip xla pallas tokamax
tar -C "$runs" -czf "$out/gpu_runs.tgz" .
