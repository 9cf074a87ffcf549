#!/usr/bin/env bash
# Session 23 call 4 (498f61c): the GPU suite beyond test_cuda.py (decode, ALiBi, soft cap, segment
# ids, block-sparse, sinks; their head-dim-96 cases now on the kernels of 96); racecheck case 13
# on the tiled dQ kernel (head dim 80 padded, sm90ws_tileddq) beside call 3's bulk-row one; the
# SASS at the PCs call 3's racecheck named (head dim 96, deterministic, bulk-row kernel).
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s); elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -2 "$out/build.log"; echo "== build $(elapsed)"
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -n 14 \
  tests/test_cuda_decode.py tests/test_alibi.py tests/test_softcap.py tests/test_segment_ids.py \
  tests/test_cuda_block_sparse.py tests/test_sinks.py -k "not differential and not on_hopper and not on_cuda" >"$out/suite.log" 2>&1
tail -2 "$out/suite.log"; grep -E "^FAILED|^ERROR" "$out/suite.log" | head -20; echo "== suite $(elapsed)"
{
  echo "### racecheck case 13, JAX_FLASH_CUDA_HD96=padded JAX_FLASH_CUDA_BACKWARD=sm90ws_tileddq"
  env JAX_FLASH_CUDA_HD96=padded JAX_FLASH_CUDA_BACKWARD=sm90ws_tileddq timeout 80 /usr/local/cuda/bin/compute-sanitizer \
    --tool racecheck --target-processes all --print-limit 3 python3 .ci/gpu/sanitize_cases.py --cases 13 2>&1 | cut -c1-300 | head -30
} >"$out/racecheck.log" 2>&1
grep -E "SUMMARY" "$out/racecheck.log"; echo "== racecheck $(elapsed)"
fn=_ZN9jax_flash4cuda24flash_bwd_sm90_ws_kernelINS0_15Sm90BwdWsTraitsILi96ELb1ELi64ELb0ELb0ELb0EEE13__nv_bfloat16Lb1ELb0ELb0ELb0EEEvNS0_12BwdTmaParamsE
/usr/local/cuda/bin/cuobjdump -sass -fun "$fn" jax_flash/_native_cuda*.so >"$out/sass_full.txt" 2>&1
grep -n -E "/\*(48[0-9a-f]0|49[0-9a-f]0|4b50|4b90|4fd0|5070|d0[0-9a-f]0|d1[0-9a-f]0)\*/" "$out/sass_full.txt" | head -80 >"$out/sass_pcs.txt"
wc -l "$out/sass_full.txt" "$out/sass_pcs.txt"; gzip "$out/sass_full.txt"
echo "== done $(elapsed)"
