#!/usr/bin/env bash
# Session 29 call 4 (the tree of call 3). The GPU tests without the kernel-choice subprocess runs
# (-n 14); the HD192_BWD kernel-choice tests (their subprocesses) and the misspelt-value test;
# call 3's A/B again in the other order (this tree first, then f5233d8's modules, each in its own
# process with cuDNN): the backward at head dims 192 and 256, seq 4096 and 8192; issue 17's value
# head dim figure (192 / 128) with tokamax.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -1 "$out/build.log"
base=/tmp/base; rm -rf $base; mkdir -p $base; cp -r jax_flash $base/
xz -dc build/baseline/_native_cuda.so.xz >$base/jax_flash/_native_cuda.cpython-312-x86_64-linux-gnu.so
cp build/baseline/_native.cpython-312-x86_64-linux-gnu.so $base/jax_flash/
PT=(python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short)
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 170 "${PT[@]}" -n 14 tests/test_cuda.py tests/test_cuda_ffi_validation.py \
  tests/test_alibi.py tests/test_softcap.py tests/test_segment_ids.py tests/test_cuda_block_sparse.py tests/test_sinks.py \
  tests/test_value_head_dim.py tests/test_cuda_decode.py -k "not differential and not on_hopper and not on_cuda" >"$out/tests.log" 2>&1
echo "tests: $(tail -1 "$out/tests.log") $(elapsed)"; grep -E "^FAILED|^ERROR" "$out/tests.log" | head -20
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 200 "${PT[@]}" -n 4 tests/test_cuda.py \
  -k "test_head_dims_to_192_backward_off_their_own_kernels_on_hopper or test_unknown_kernel_choice_is_an_error" \
  >"$runs/choice.log" 2>&1
echo "kernel-choice tests: $(tail -1 "$runs/choice.log") $(elapsed)"; grep -E "^FAILED|^E " "$runs/choice.log" | head -8
B=(python3 -m jax_flash.benchmark --platform gpu --reps 5 --seqs 4096 8192 --head-dims 192 256 --causal both
   --skip xla pallas tokamax)
{
  echo "### this tree"
  timeout -s KILL 100 "${B[@]}" --out "$runs/new" 2>"$runs/new_progress.log"
  echo "== new $(elapsed)"
  echo "### baseline (f5233d8's modules)"
  (cd $base && PYTHONPATH=$base timeout -s KILL 100 "${B[@]}" --out "$OLDPWD/$runs/base" 2>"$OLDPWD/$runs/base_progress.log")
  echo "== base $(elapsed)"
} 2>&1 | grep -v "unavailable: skipped" | grep -E "^#|^==|^\| [0-9]" | grep -v "| fwd |" | tee "$out/bench.log"
source .ci/gpu/tokamax_peer.sh
timeout -s KILL 100 python3 -m jax_flash.benchmark --platform gpu --reps 5 --seqs 4096 8192 --head-dims 192 \
  --value-head-dim 128 --skip xla pallas 2>/dev/null >"$out/value_head_dim.md"
grep -E "^\| [0-9]" "$out/value_head_dim.md"; echo "== value head dim $(elapsed)"
tar czf "$out/runs.tgz" "$runs"
echo "== done $(elapsed)"
