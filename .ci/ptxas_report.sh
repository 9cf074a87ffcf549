#!/usr/bin/env bash
# ptxas's view of the Hopper kernels, compiled here (no GPU needed): registers, spills, and the
# C75xx notes that say wgmma was serialised ("Potential Performance Loss"), which are errors
# for us (exit status 1). Run after changing anything under cuda/sm90 or cuda/gpu (the decode
# kernel, cuda/gpu/flash_decode.cu, is mma.sync code, checked here for its spills).
#   usage: bash .ci/ptxas_report.sh [cuda/sm90/<file>.cu ...]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
files=("$@")
[[ ${#files[@]} == 0 ]] && files=(cuda/sm90/*.cu cuda/gpu/flash_decode.cu)
status=0
for f in "${files[@]}"; do
  log=$(nvcc -O3 -std=c++17 --expt-relaxed-constexpr -DNDEBUG -gencode=arch=compute_90a,code=sm_90a -Icuda \
    -Xptxas -v -c "$f" -o /dev/null 2>&1) || { echo "$f: compile failed"; echo "$log" | tail -20; status=1; continue; }
  spills=$(echo "$log" | grep -c "[1-9][0-9]* bytes spill stores")
  serialised=$(echo "$log" | grep -c "C75[0-9][0-9]")
  echo "$f: $(echo "$log" | grep -c 'Compiling entry') kernels, $spills with spills, $serialised wgmma serialisation notes"
  if [[ $serialised != 0 ]]; then
    echo "$log" | grep "C75[0-9][0-9]" | cut -c1-200
    status=1
  fi
done
exit "$status"
