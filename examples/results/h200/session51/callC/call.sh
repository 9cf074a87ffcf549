#!/usr/bin/env bash
# Session 51, call C: the forward's epilogue without per-element branches (store_output's mode a
# template constant, rounding_error branch-free) against the committed kernels (build/baseline:
# the modules of session 50's call B, the same CUDA sources as a7b8728), each in its own process
# with cuDNN: head dim 256 (whose O is stored from registers) and 128 (whose differentiated
# forward stores O and its rounding errors from registers); then test_cuda.py's main selection.
# Not run in session 51 (no budget left to start a machine). To run it: `git apply
# examples/results/h200/session51/epilogue_modes.diff`, `bash .ci/gpu/prebuilt.sh build && bash
# .ci/gpu/prebuilt.sh pack`, main's own modules (xz'd _native_cuda, as `pack` names it) in
# build/baseline, and carry ["build/prebuilt_xz", "build/baseline"].
export BUDGET_S=${BUDGET_S:-165}; set -uo pipefail; source .ci/gpu/call_preamble.sh
bench_variants 40 base=base new=tree -- --seqs 1024 2048 --head-dims 256 --causal both --skip xla pallas tokamax
for l in base new; do mv $out/bench_$l.md $out/hd256_$l.md; done
bench_variants 40 base=base new=tree -- --seqs 1024 4096 --head-dims 128 --causal both --skip xla pallas tokamax
step suite 120 "${PT[@]}" -n 10 -rf tests/test_cuda.py -k "not on_hopper and not on_cuda"
