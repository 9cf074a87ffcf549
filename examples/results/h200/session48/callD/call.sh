#!/usr/bin/env bash
# Session 48, call D: the table of record of issue 14 at the session's defaults (the end-aligned
# tiles and the skipped unseen blocks since 9ac6b1f): head dims 128, 64 and 256, seq 1024-16384,
# causal and not, forward and fwd+bwd, with cuDNN (through jax.nn) and tokamax 0.0.17 in the
# same process (session 26's command).
#   run from the repository root on the GPU machine: bash examples/results/h200/session48/callD/call.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-420} source .ci/gpu/call_preamble.sh  # (benchmark_to)
benchmark_to table "$out/table.md" $(( $(left) - 15 )) --causal both --seqs ${SEQS:-1024 2048 4096 8192 16384} \
  --head-dims ${HDS:-128 64 256}
echo "== table $(elapsed)"; grep -E "^\| [0-9]" "$out/table.md" | cut -c1-130
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
