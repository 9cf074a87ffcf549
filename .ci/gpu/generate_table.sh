#!/usr/bin/env bash
# Issue 15's generation table: a small model trained briefly with examples/train_lm.py (orbax
# checkpoints), then examples/generate.py on it at each batch size in GEN_BATCHES with each
# attention in COMPARE: prefill and decode tokens/s, greedy, prompts of the validation text.
# The table goes to stdout; logs, the checkpoint and generate.json to $OUT/generate (or
# ./gpu_out/generate). Sizes (the defaults are for one GPU, about a minute) can be overridden,
# the rest of the commands cannot: a CPU run with tiny sizes (tests/test_examples.py) runs the
# same commands, e.g.
#   COMPARE=jax_flash,xla GEN_BATCHES=1,4 TRAIN_SIZE="--layers 1 --width 32 --heads 2 --seq-len 64
#   --batch-size 4 --steps 4 --max-data-bytes 200000" GEN_SIZE="--prompt-bytes 16 --new-tokens 17"
#   bash .ci/gpu/generate_table.sh
set -euo pipefail
export PYTHONUNBUFFERED=1  # the logs hold what ran before a time limit stops it
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out="${OUT:-gpu_out}/generate"
rm -rf "$out/checkpoints"
mkdir -p "$out"
compare=${COMPARE:-jax_flash,xla,cudnn}
batches=${GEN_BATCHES:-1,64}
# head dim 128 (width 512 / 4 heads), 4 query heads per kv head; prompt + new bytes - 1 = 512,
# the trained length (the last new byte is never fed back).
train_size=${TRAIN_SIZE:---layers 4 --width 512 --heads 4 --kv-heads 1 --seq-len 512 --batch-size 16 --steps 40}
gen_size=${GEN_SIZE:---prompt-bytes 256 --new-tokens 257}
start=$(date +%s)

# shellcheck disable=SC2086
python3 examples/train_lm.py $train_size --dtype bfloat16 --eval-every 1000000 --eval-batches 1 \
  --sample-bytes 8 --no-progress --out "$out/run" --checkpoint-dir "$out/checkpoints" \
  >"$out/train.log" 2>&1 || { tail -30 "$out/train.log"; exit 1; }
echo "trained in $(( $(date +%s) - start )) s: $(grep -E '^loss ' "$out/train.log" | tail -1)"

# shellcheck disable=SC2086
python3 examples/generate.py --checkpoint-dir "$out/checkpoints" --compare "$compare" \
  --dtype bfloat16 --batch "$batches" $gen_size --temperature 0 --repeats 3 \
  --out "$out/generate.json" >"$out/generate.log" 2>&1 || { tail -30 "$out/generate.log"; exit 1; }
grep -E "^attention .*(tokens/s|skipped)|vs " "$out/generate.log" | cut -c1-240 || true
sed -n '/^tokens\/s/,/^wrote/p' "$out/generate.log" | grep -v '^wrote'
echo "generate: $(( $(date +%s) - start )) s in all"
