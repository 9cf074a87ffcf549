#!/usr/bin/env bash
# Session 47, call A: session 46's calls 1 and 2 cut to one call (the pool had given session 46
# no machine and session 47 its first two starts refused): with flip_defaults.diff applied (the
# end-aligned tiles and the skipped unseen blocks the default), the GPU suite's main file (its
# subprocess tests aside), the NaN cases, compute-sanitizer memcheck and racecheck on the odd
# head-dim-64 case 18 (the 192-row tiles the default changes), then head dim 64 causal at seq
# 1024-8192: the new default against the session-45 default (start + compute), each in its own
# process with cuDNN and tokamax.
#   run from the repository root on the GPU machine: bash examples/results/h200/session47/callA/call.sh
set -uo pipefail
grep -q 'read_switch(kForwardRowsVariable, "end"' cuda/gpu/kernel_choice.cu ||
  { echo "apply examples/results/h200/session46/flip_defaults.diff first"; exit 1; }
BUDGET_S=${BUDGET_S:-570} source .ci/gpu/call_preamble.sh  # (step, bench_variants)
step suite_cuda 200 "${PT[@]}" -n 14 tests/test_cuda.py -k "not on_hopper and not on_cuda"
step suite_nan 35 "${PT[@]}" -n 8 tests/test_nan_propagation.py -k cuda
CS=/usr/local/cuda/bin/compute-sanitizer
for tool in memcheck racecheck; do
  step ${tool}_18 55 $CS --tool $tool --print-limit 4 python3 .ci/gpu/sanitize_cases.py --cases 18
  grep -E "SUMMARY" "$out/${tool}_18.log"
done
bench_variants ${VARIANT_S:-75} default=tree start_compute=JAX_FLASH_CUDA_FWD_ROWS=start,JAX_FLASH_CUDA_FWD_UNSEEN=compute -- \
  --seqs ${SEQS:-1024 2048 4096 8192} --head-dims 64 --causal yes
mkdir -p "$runs/logs" && mv "$out"/*.log "$runs/logs"/
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
