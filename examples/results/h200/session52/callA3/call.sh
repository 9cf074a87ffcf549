#!/usr/bin/env bash
# Session 52, call A3 (inline, same warm H100): compute-sanitizer memcheck under the 16-byte
# stores on sanitize_cases.py's cases 0 (head dim 40), 2 (256, causal window) and 17 (160 / 120,
# window), a case a process; then vectors against pairs again, in the other order.
export BUDGET_S=380; set -uo pipefail; source .ci/gpu/call_preamble.sh
CS=/usr/local/cuda/bin/compute-sanitizer
for c in 0 2 17; do
  step memcheck_$c 55 env JAX_FLASH_CUDA_FWD_STORES=vectors $CS --tool memcheck --print-limit 4 python3 .ci/gpu/sanitize_cases.py --cases $c
  grep -E "^case|SUMMARY" "$out/memcheck_$c.log" | tr '\n' ' '; echo
done
bench_variants 40 vectors=JAX_FLASH_CUDA_FWD_STORES=vectors pairs=tree -- --seqs 1024 2048 --head-dims 256 --causal both --skip xla pallas tokamax
for l in pairs vectors; do mv $out/bench_$l.md $out/r2_hd256_$l.md; done
bench_variants 40 vectors=JAX_FLASH_CUDA_FWD_STORES=vectors pairs=tree -- --seqs 1024 4096 --head-dims 128 --causal both --skip xla pallas tokamax
