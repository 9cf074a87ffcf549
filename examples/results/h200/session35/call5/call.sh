#!/usr/bin/env bash
# For the next GPU session (written in session 35, not yet run): (1) the stalled forward of
# call 3 narrowed further: the probes under each tile grid (a CTA a tile, the static pairs, the
# counter) and with more tiles than SMs, then compute-sanitizer's synccheck on one stalling call;
# (2) the forward's bias tiles by TMA (JAX_FLASH_CUDA_BIAS_LOADS=tma): the staged cases and the
# forward's times beside the producer warp's copies; (3) where the lean staged-bias forward spends
# its time: Nsight Compute's source counters (stall reasons by SASS line) on it and on the plain
# forward.
#   run from the repository root on the GPU machine: bash examples/results/h200/session35/call5/call.sh
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
# (JAX_FLASH_CUDA_CAUSAL_ARRAYS=run: the stalling calls launched, not refused.)
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_FLASH_CUDA_LOGIT_ARRAYS=on JAX_FLASH_CUDA_CAUSAL_ARRAYS=run
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -1 "$out/build.log"; echo "build $(elapsed)"; nvidia-smi --query-gpu=name --format=csv,noheader
probe=examples/results/h200/session35/call3/probe_forward.py
run_probe() {  # $1: label (JAX_FLASH_CUDA_FORWARD or "default"), $2: configuration
  local env=(); [[ $1 != default ]] && env=(JAX_FLASH_CUDA_FORWARD=$1)
  env "${env[@]}" timeout -s KILL 50 python3 $probe "$2" >"$runs/pf_$1_$2.log" 2>&1
  echo "$1 $2 rc=$? $(grep -E 'done$' "$runs/pf_$1_$2.log" | sed 's/.*: //' | tr '\n' ' ')"
}
for grid in sm90ws_grid sm90ws_dynamic sm90ws_static; do
  for c in mask-causal-1block f32bias-causal-1block f32bias-window-1block; do run_probe $grid $c & done
done
for c in f32bias-noncausal-2blocks-manytiles f32bias-window-1block-manytiles ids-causal-1block-manytiles; do
  run_probe default $c &
done
wait
echo "probes $(elapsed)"
timeout -s KILL 60 /usr/local/cuda/bin/compute-sanitizer --tool synccheck --print-limit 8 python3 $probe \
  mask-causal-1block >"$runs/synccheck_mask_causal.log" 2>&1
echo "synccheck: rc=$? $(grep -cE 'Barrier|barrier|divergent' "$runs/synccheck_mask_causal.log") barrier reports $(elapsed)"
grep -E "Barrier|barrier|divergent|at .* in" "$runs/synccheck_mask_causal.log" | head -12 | cut -c1-200
# The forward's bias tiles by TMA (JAX_FLASH_CUDA_BIAS_LOADS=tma, not yet run): the staged cases,
# then the forward's times beside the producer's copies (call 1's script).
JAX_FLASH_CUDA_CAUSAL_ARRAYS=refuse JAX_FLASH_CUDA_BIAS_LOADS=tma XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s KILL 120 \
  python3 -m pytest -q -m gpu -p no:cacheprovider -n 8 tests/test_cuda_logit_arrays.py -k "against_jax_nn and staged" \
  >"$runs/tma_staged_tests.log" 2>&1
echo "tma staged cases: $(tail -1 "$runs/tma_staged_tests.log") $(elapsed)"; grep -E "^FAILED|^E " "$runs/tma_staged_tests.log" | head -10
for loads in staged tma; do
  JAX_FLASH_CUDA_BIAS_LOADS=$loads timeout -s KILL 90 python3 examples/results/h200/session35/call1/bias_forward_times.py \
    --label $loads 2>"$runs/times_$loads.err" | grep -E "plain|bias \(1,N" | tee -a "$out/times.log"
done
echo "times $(elapsed)"
NCU=(/usr/local/cuda/bin/ncu --clock-control none -c 1 --section SourceCounters --section WarpStateStats --section SpeedOfLight)
for what in bias plain; do
  flag=(); [[ $what == bias ]] && flag=(--bias)
  timeout -s KILL 90 "${NCU[@]}" -k regex:flash_fwd python3 .ci/gpu/profile_attention.py --forward-only "${flag[@]}" \
    >"$runs/ncu_src_$what.txt" 2>&1
  echo "ncu $what: $(grep -E '^    Duration' "$runs/ncu_src_$what.txt" | head -1) $(elapsed)"
done
tar czf "$out/gpu_runs.tgz" "$runs"; echo "== done $(elapsed)"
