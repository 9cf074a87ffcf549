#!/usr/bin/env bash
# Session 48, call G: the bisection of call F's regression (head dim 256's forward at seq 1024:
# a076682 465 TFLOP/s, e1996ef 360 on one H100) at the change session 48 suspected first: the
# consumers' turns running on across a CTA's tiles, every forward's order since 89faeaf, which its
# parent 5502214 still had behind JAX_FLASH_CUDA_FWD_TURNS=across_tiles (default per_tile). That
# tree (built here for sm_90a, its package carried as .old_tree) under each order, one process
# each, cuDNN in each.
#   here: bash .ci/gpu/tree_at.sh 5502214 .old_tree; carry .old_tree.
#   run from the repository root on the GPU machine: bash examples/results/h200/session48/callG/call.sh
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=$PWD/gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
nvidia-smi --query-gpu=name --format=csv,noheader
for packed in .old_tree/jax_flash/_native_cuda*.so.xz; do [[ -f $packed ]] && xz -dc "$packed" >"${packed%.xz}"; done
ARGS=(--platform gpu --reps 5 --skip xla pallas tokamax --seqs ${SEQS:-1024 2048} --head-dims 256 --causal ${CAUSAL:-both})
for turns in per_tile across_tiles; do
  (cd .old_tree && JAX_FLASH_CUDA_FWD_TURNS=$turns PYTHONPATH=$PWD timeout -s KILL ${TREE_S:-75} python3 -m \
    jax_flash.benchmark "${ARGS[@]}" --out "$runs/$turns" 2>"$runs/${turns}_progress.log" >"$runs/bench_$turns.md")
  cp "$runs/bench_$turns.md" "$out/"
  echo "== $turns $(elapsed)"; grep -E "^\| [0-9]" "$runs/bench_$turns.md" | cut -c1-110
done
tar czf "$out/gpu_runs.tgz" -C "$(dirname "$runs")" "$(basename "$runs")"
echo "== done $(elapsed)"
