#!/usr/bin/env bash
# Session 36, call 1: the forward's turn barrier no longer ends at each tile (the hang of session
# 35's arrays' kernel, cuda/PERF_NOTES.md v34), the bias's tiles by TMA by default (the forward's
# and now the backward's), the mask as bits in the fragments' order (cuda_mask_bits):
# session 35's stalled probes under each tile grid, the arrays' GPU tests whole (the refusal
# dropped; the many-tile cases new), memcheck and racecheck on the TMA path and on calls that
# hung, the forward's times and the benchmark's --bias rows beside cuDNN and tokamax, then the
# CUDA suite's main files; every forward with its turns across tiles (JAX_FLASH_CUDA_FWD_TURNS).
#   run from the repository root on the GPU machine: bash examples/results/h200/session36/call1/call.sh
set -uo pipefail
source .ci/gpu/call_preamble.sh
probe=examples/results/h200/session35/call3/probe_forward.py
run_probe() {  # $1: JAX_FLASH_CUDA_FORWARD value or "default", $2: configuration
  local env=(JAX_FLASH_CUDA_LOGIT_ARRAYS=on); [[ $1 != default ]] && env+=(JAX_FLASH_CUDA_FORWARD=$1)
  env "${env[@]}" timeout -s KILL 60 python3 $probe "$2" >"$runs/pf_$1_$2.log" 2>&1
  echo "$1 $2 rc=$? $(grep -E 'done$' "$runs/pf_$1_$2.log" | sed 's/.*: //' | tr '\n' ' ')"
}
for c in mask-causal-1block f32bias-causal-1block f32bias-causal-2blocks; do run_probe default $c & done
for c in mask-causal-1block f32bias-window-1block; do run_probe sm90ws_static $c & done
for c in f32bias-noncausal-2blocks-manytiles f32bias-window-1block-manytiles mask-causal-1block-manytiles; do
  run_probe default $c &
done
wait
echo "probes $(elapsed)"
JAX_FLASH_CUDA_LOGIT_ARRAYS=on XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 200 "${PT[@]}" -n 8 \
  tests/test_cuda_logit_arrays.py -k "against_jax_nn or row_the_mask or block_diagonal" >"$out/array_tests.log" 2>&1
echo "array tests (tma default): $(tail -1 "$out/array_tests.log") $(elapsed)"
grep -E "^FAILED|^ERROR|^E " "$out/array_tests.log" | head -20
for loads in staged direct; do
  JAX_FLASH_CUDA_LOGIT_ARRAYS=on JAX_FLASH_CUDA_BIAS_LOADS=$loads XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 120 \
    "${PT[@]}" -n 8 tests/test_cuda_logit_arrays.py -k "against_jax_nn and (staged or many-tiles)" >"$out/array_tests_$loads.log" 2>&1
  echo "array tests ($loads): $(tail -1 "$out/array_tests_$loads.log") $(elapsed)"
  grep -E "^FAILED|^ERROR" "$out/array_tests_$loads.log" | head -10
done
# Every forward's turns across tiles (JAX_FLASH_CUDA_FWD_TURNS=across_tiles, off by default until
# this passes and call 2 times it) and a forward of more tiles than SMs under each grid.
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 240 "${PT[@]}" -n 3 tests/test_cuda.py \
  -k "more_tiles_than_sms or turns_across_tiles" >"$out/turns_tests.log" 2>&1
echo "turns tests: $(tail -1 "$out/turns_tests.log") $(elapsed)"; grep -E "^FAILED|^ERROR" "$out/turns_tests.log" | head -10
JAX_FLASH_CUDA_LOGIT_ARRAYS=on timeout -s KILL 120 python3 examples/results/h200/session35/call1/bias_forward_times.py \
  --label tma --peers 2>"$runs/times.err" | tee "$out/times.log"
tail -2 "$runs/times.err" | cut -c1-300; echo "$(elapsed)"
JAX_FLASH_CUDA_LOGIT_ARRAYS=on timeout -s KILL 120 python3 -m jax_flash.benchmark --platform gpu --reps 5 --seqs 4096 \
  --causal both --head-dims 128 --skip xla pallas --bias --out "$runs/bias_bench" 2>"$runs/bias_bench_progress.log" >"$out/bias_bench.md"
echo "== benchmark --bias $(elapsed)"; grep -E "^\| [0-9]" "$out/bias_bench.md" | cut -c1-200
# compute-sanitizer: a case a process, killed by timeout, output to a file (cuda/PERF_NOTES.md).
sanitize() {  # $1 tool, $2 label, rest: sanitize_cases.py arguments
  local tool=$1 label=$2; shift 2
  (( $(left) > 60 )) || { echo "$tool $label: skipped (time)"; return; }
  timeout -s KILL 55 /usr/local/cuda/bin/compute-sanitizer --tool $tool --print-limit 4 \
    python3 .ci/gpu/sanitize_cases.py "$@" >"$runs/${tool}_$label.log" 2>&1
  echo "$tool $label: rc=$? $(grep -E "^case|SUMMARY" "$runs/${tool}_$label.log" | cut -c1-60 | tr '\n' ' ') $(elapsed)"
  grep -E "Invalid|Race|hazard|rror" "$runs/${tool}_$label.log" | grep -v "0 errors" | head -4
}
sanitize memcheck tma_bias_alone_6 --logit-arrays --bias-alone --cases 6
sanitize racecheck tma_bias_alone_6 --logit-arrays --bias-alone --cases 6
sanitize racecheck tma_bias_mask_6 --logit-arrays --cases 6
sanitize memcheck mask_1_5 --logit-arrays --cases 1,5
sanitize racecheck mask_5 --logit-arrays --cases 5
if (( $(left) > 100 )); then
  XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL $(( $(left) - 10 )) "${PT[@]}" -n 14 \
    tests/test_cuda.py tests/test_cuda_ffi_validation.py -k "not differential and not on_hopper and not on_cuda" >"$out/cuda_suite.log" 2>&1
  echo "CUDA suite main files: $(tail -1 "$out/cuda_suite.log") $(elapsed)"; grep -E "^FAILED|^ERROR" "$out/cuda_suite.log" | head -20
fi
tar czf "$out/gpu_runs.tgz" "$runs"
echo "== done $(elapsed)"
