#!/usr/bin/env bash
# Session 25 call 2: why the head dim 64 forward leaves its SMs idle 18-20% of the kernel at seq
# 2048-4096 (call 1's Nsight Compute: SM active cycles 80.5% / 81.5% of elapsed, cuDNN's 96.9%).
# Each forward kernel choice (persistent default, a CTA per tile, the 128-row tiles) beside cuDNN
# at head dims 64 and 128; the same with head dim 64's forward in 4 K/V stages instead of 2
# (build/variant_b: this tree with gpu/tile_shapes.cuh's hd64 stages at 4); and the spread of
# the SMs' active cycles (min / avg / max) for the persistent and the per-tile grid.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -2 "$out/build.log"; echo "== build $(elapsed)"
vb=/tmp/variant_b; rm -rf $vb; mkdir -p $vb; cp -r jax_flash $vb/
xz -dc build/variant_b/_native_cuda.so.xz >$vb/jax_flash/_native_cuda.cpython-312-x86_64-linux-gnu.so
cp build/variant_b/_native.cpython-312-x86_64-linux-gnu.so $vb/jax_flash/
FV=(python3 .ci/gpu/forward_variants.py --reps 10)
{
  echo "### this tree: kernel choices"
  timeout 260 "${FV[@]}" --variants default sm90ws_grid sm90ws_narrow --head-dims 64 128 --seqs 1024 4096 8192 \
    --out "$runs/choices" 2>"$runs/choices_progress.log"
  echo "== choices $(elapsed)"
  echo "### variant_b (hd64 forward in 4 stages)"
  (cd $vb && PYTHONPATH=$vb timeout 120 python3 "$OLDPWD/.ci/gpu/forward_variants.py" --reps 10 --variants default sm90ws_narrow \
    --head-dims 64 --seqs 1024 4096 8192 --out "$OLDPWD/$runs/stages4" 2>"$OLDPWD/$runs/stages4_progress.log")
  echo "== stages4 $(elapsed)"
} 2>&1 | tee "$out/variants.log"
NCU=(/usr/local/cuda/bin/ncu --clock-control none -k regex:'flash_fwd_sm90' -c 1
     --metrics 'sm__cycles_active.min,sm__cycles_active.avg,sm__cycles_active.max,sm__cycles_elapsed.max,gpu__time_duration.sum')
for choice in sm90ws sm90ws_grid; do
  JAX_FLASH_CUDA_FORWARD=$choice timeout 60 "${NCU[@]}" python3 .ci/gpu/profile_attention.py --forward-only --seq 4096 --head-dim 64 \
    >"$runs/ncu_spread_$choice.txt" 2>&1
done
(cd $vb && PYTHONPATH=$vb timeout 60 "${NCU[@]}" python3 "$OLDPWD/.ci/gpu/profile_attention.py" --forward-only --seq 4096 --head-dim 64 \
  >"$OLDPWD/$runs/ncu_spread_stages4.txt" 2>&1)
for f in "$runs"/ncu_spread_*.txt; do echo "== $f"; grep -E "sm__cycles|gpu__time" "$f"; done | tee "$out/ncu.log"
tar czf "$out/runs.tgz" "$runs"
echo "== done $(elapsed)"
