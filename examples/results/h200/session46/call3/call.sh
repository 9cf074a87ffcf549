#!/usr/bin/env bash
# Session 46, call 3: each layout alone (the end-aligned tiles without the skip, the skip with the
# tiles from row 0) on head dim 64 causal; the non-causal rows (where the skip drops only the
# warpgroups made wholly of padding rows); head dim 128 causal (128-row tiles, which meet unseen
# blocks only with T != S, windows or lengths) with and without the skip, to see that its code
# costs the plain loop nothing. Each variant in its own process with cuDNN and tokamax. First the
# CHAIN timeline (the tiles' phases; of each block S in and the softmax done) of the new default
# at seq 1024 and 2048, causal, from a copy of the package with that debug build's module (built
# on the development machine from this tree: build/timeline_CHAIN), to see the per-tile fixed cost.
#   run from the repository root on the GPU machine: bash examples/results/h200/session46/call3/call.sh
set -uo pipefail
# (written for the tree with flip_defaults.diff applied: session 46 could not run it)
grep -q 'read_switch(kForwardRowsVariable, "end"' cuda/gpu/kernel_choice.cu ||
  { echo "apply examples/results/h200/session46/flip_defaults.diff first"; exit 1; }
BUDGET_S=${BUDGET_S:-560} source .ci/gpu/call_preamble.sh  # (bench_variants)
seqs=${SEQS:-1024 2048 4096 8192}
if [[ ${TIMELINE:-yes} == yes ]]; then
  script=$PWD/.ci/gpu/fwd_timeline.py
  bash .ci/gpu/package_copy.sh /tmp/tl_CHAIN build/timeline_CHAIN >/dev/null
  for seq in 1024 2048; do
    mkdir -p "$runs/CHAIN"
    (cd /tmp/tl_CHAIN && PYTHONPATH=/tmp/tl_CHAIN timeout -s KILL 60 python3 "$script" --out "$OLDPWD/$runs/CHAIN" \
      --head-dim 64 --causal --seq $seq) >>"$out/CHAIN.md" 2>"$runs/CHAIN/hd64_causal_$seq.err"
    echo "== CHAIN seq $seq rc=$? $(elapsed)"; tail -2 "$runs/CHAIN/hd64_causal_$seq.err"
  done
  grep -E "^# |^\| (loop |tile|first_s|.*->tile)" "$out/CHAIN.md" | cut -c1-160 | head -60
fi
bench_variants 80 end_compute=JAX_FLASH_CUDA_FWD_UNSEEN=compute start_skip=JAX_FLASH_CUDA_FWD_ROWS=start -- \
  --seqs $seqs --head-dims 64 --causal yes
bench_variants 60 default_nc=tree start_compute_nc=JAX_FLASH_CUDA_FWD_ROWS=start,JAX_FLASH_CUDA_FWD_UNSEEN=compute -- \
  --seqs $seqs --head-dims 64 --causal no
bench_variants 45 default128=tree compute128=JAX_FLASH_CUDA_FWD_UNSEEN=compute -- --seqs 2048 8192 --head-dims 128 --causal yes
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
