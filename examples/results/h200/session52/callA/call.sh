#!/usr/bin/env bash
# Session 52, call A (run on an H100: README.md beside this folder). The forward's
# 16-byte O stores (JAX_FLASH_CUDA_FWD_STORES=vectors, gpu/epilogue.cuh store_output_vectors)
# against the pair stores of the same modules (`pairs`, the default then) and against the modules of
# before the switch (build/baseline: session 50's, the epilogue as it was; whether the switch's
# code costs the default anything), each in its own process with cuDNN: head dim 256 (the plain
# forward stores O from registers; ~14,000 cycles a tile, v50) and 128 (the differentiated
# forward stores O and its rounding errors from registers: fwd+bwd). Then the switch's own test
# (its two subprocess selections, Hopper and mma.sync kernels) and test_cuda.py's main selection.
# Needs: this tree's modules built and packed (`bash .ci/gpu/prebuilt.sh build && bash
# .ci/gpu/prebuilt.sh pack`), build/baseline, carry ["build/prebuilt_xz", "build/baseline"].
export BUDGET_S=${BUDGET_S:-480}; set -uo pipefail; source .ci/gpu/call_preamble.sh
variants=(base=base pairs=tree vectors=JAX_FLASH_CUDA_FWD_STORES=vectors)
bench_variants 45 "${variants[@]}" -- --seqs 1024 2048 --head-dims 256 --causal both --skip xla pallas tokamax
for l in base pairs vectors; do mv $out/bench_$l.md $out/hd256_$l.md; done
bench_variants 45 "${variants[@]}" -- --seqs 1024 4096 --head-dims 128 --causal both --skip xla pallas tokamax
step vector_tests 200 "${PT[@]}" -n 3 -rf tests/test_cuda.py -k "test_forward_vector_stores_on_cuda or test_unknown_kernel_choice_is_an_error"
step suite 120 "${PT[@]}" -n 10 -rf tests/test_cuda.py tests/test_nan_propagation.py -k "not on_hopper and not on_cuda"
tar -C "$runs" -czf "$out/gpu_runs.tgz" .
