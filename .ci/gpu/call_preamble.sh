# Sourced first by a device call's script (from the repository root on the GPU machine, under
# `set -uo pipefail`): the folders that come back (`out`: $OUT, at most 8 files; `runs`: logs to
# tar into it), `elapsed` and `left` (seconds of the call's budget left, BUDGET_S or 570), the
# native modules (build/prebuilt when its stamp matches, else built here: .ci/gpu/prebuilt.sh),
# the GPU's name, tokamax as a peer where its wheels came (.ci/gpu/tokamax_peer.sh), PT, the
# pytest command of the GPU tests (XLA's autotuning off), and the helpers `step`, `bench` and
# `bench_variants` (below).
out=${OUT:-gpu_out}; mkdir -p "$out"; runs=gpu_runs; mkdir -p "$runs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s)
elapsed() { echo "[$(( $(date +%s) - start )) s]"; }
left() { echo $(( ${BUDGET_S:-570} - $(date +%s) + start )); }
: >"$out/build.log"
source .ci/gpu/prebuilt.sh use-or-build "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
head -1 "$out/build.log"; echo "build $(elapsed)"; nvidia-smi --query-gpu=name --format=csv,noheader
source .ci/gpu/tokamax_peer.sh
# (XLA's autotuning off in the tests: with it each reference case took 70-80 s instead of 3-4 s at
# -n 8, session 41 call 2; the benchmarks keep it.)
PT=(env XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rs)

# A step of a call: `step LOG SECONDS COMMAND...` runs the command with its output in $out/LOG.log,
# at most SECONDS and never past the budget (skipped under 40 s left), then prints its exit code,
# last line and failures.
step() {
  local name=$1 limit=$2; shift 2
  (( $(left) > 40 )) || { echo "== $name: skipped (time)"; return; }
  (( limit > $(left) - 15 )) && limit=$(( $(left) - 15 ))
  timeout -s KILL "$limit" "$@" >"$out/$name.log" 2>&1
  echo "== $name: rc=$? $(tail -1 "$out/$name.log" | cut -c1-200) $(elapsed)"
  grep -E "^FAILED|^ERROR|^E  " "$out/$name.log" | head -12
}

# One benchmark process: `benchmark_to LABEL TABLE SECONDS ARGS...` runs python -m
# jax_flash.benchmark on the GPU with cuDNN and tokamax (xla and pallas skipped) and ARGS, at most
# SECONDS, its table in TABLE and its --out folder in $runs/LABEL.
benchmark_to() {
  local label=$1 table=$2 limit=$3; shift 3
  local runs_dir; runs_dir=$(cd "$runs" && pwd)
  timeout -s KILL "$limit" python3 -m jax_flash.benchmark --platform gpu --reps 5 --skip xla pallas \
    --out "$runs_dir/$label" "$@" 2>"$runs_dir/${label}_progress.log" >"$table"
}

# A benchmark of a call: `bench LABEL SECONDS ARGS...` runs benchmark_to at seq 4096, causal and
# not, and ARGS, its table in $out/LABEL.md (skipped under 60 s left).
bench() {
  local label=$1 limit=$2; shift 2
  (( $(left) > 60 )) || { echo "== $label: skipped (time)"; return; }
  (( limit > $(left) - 20 )) && limit=$(( $(left) - 20 ))
  benchmark_to "$label" "$out/$label.md" "$limit" --seqs 4096 --causal both "$@"
  echo "== $label $(elapsed)"; grep -E "^\| [0-9]" "$out/$label.md" | cut -c1-200
}

# The same benchmark for kernel variants side by side, each in its own process:
# `bench_variants SECONDS LABEL=SPEC ... -- ARGS...` runs benchmark_to with ARGS once per
# LABEL=SPEC, where SPEC is `base` (the committed modules carried in build/baseline, through a
# package copy made once), `tree` (this tree's) or VAR=VALUE[,VAR=VALUE...] (this tree's under
# those environment variables, e.g. kernel-choice switches); tables in $out/bench_LABEL.md,
# --out folders in $runs/LABEL; then the forward and fwd+bwd rows of each.
bench_variants() {
  local limit=$1; shift
  local specs=()
  while (( $# )) && [[ $1 != -- ]]; do specs+=("$1"); shift; done
  shift
  local out_dir spec label setting
  out_dir=$(cd "$out" && pwd)
  for spec in "${specs[@]}"; do
    label=${spec%%=*} setting=${spec#*=}
    (( $(left) > 60 )) || { echo "== $label: skipped (time)"; continue; }
    if [[ $setting == base ]]; then
      [[ -d /tmp/base/jax_flash ]] || bash .ci/gpu/package_copy.sh /tmp/base build/baseline
      (runs=$(cd "$runs" && pwd) && cd /tmp/base &&
        PYTHONPATH=/tmp/base:${PYTHONPATH:-} benchmark_to "$label" "$out_dir/bench_$label.md" "$limit" "$@")
    elif [[ $setting == tree ]]; then
      benchmark_to "$label" "$out_dir/bench_$label.md" "$limit" "$@"
    else
      (IFS=, && for assignment in $setting; do export "$assignment"; done &&
        benchmark_to "$label" "$out_dir/bench_$label.md" "$limit" "$@")
    fi
    echo "== $label ($setting) $(elapsed)"
  done
  for spec in "${specs[@]}"; do
    label=${spec%%=*}
    echo "-- $label"; grep -E "^\| [0-9]+ \| [0-9]+ \| [NY] \| (fwd|fwd\+bwd) " "$out/bench_$label.md" | cut -c1-110
  done
}
