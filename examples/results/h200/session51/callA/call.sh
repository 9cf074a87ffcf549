#!/usr/bin/env bash
# Session 51, call A: the GPU tests of main (a7b8728) with names (-v: a line a test, so a step cut
# off still names its failures), every `-m gpu` file but the decode file, at -n 10 (-n 8 on an 80 GB card); then the head
# dim 256 table (cuDNN and tokamax in the process).
export BUDGET_S=${BUDGET_S:-490}; set -uo pipefail; source .ci/gpu/call_preamble.sh
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1); workers=$(( mib > 100000 ? 10 : 8 )); echo "$mib MiB: -n $workers"
step gpu_tests 330 "${PT[@]}" -n $workers -v -rf --tb=line tests/ --ignore=tests/test_cuda_decode.py
grep -E " (FAILED|ERROR) " $out/gpu_tests.log | head -40
grep -c " PASSED " $out/gpu_tests.log
benchmark_to hd256_table "$out/hd256_table.md" $(( $(left) - 10 )) --seqs 1024 2048 4096 8192 16384 --head-dims 256 --causal both
echo "== hd256_table $(elapsed)"; grep -E "^\| [0-9]" "$out/hd256_table.md" | cut -c1-200
tar -C "$runs" -czf "$out/gpu_runs.tgz" .
