#!/bin/bash
# usage: bench.sh SO_PATH TAG [DTYPE] [SEQS...] -- swaps the module in, runs the benchmark, records load
set -e
SO=$1; TAG=$2; DT=${3:-float32}; shift 3 || true; SEQS=${@:-2048 4096 8192}
SP=/tmp/wt19venv/lib/python3.12/site-packages/jax_flash/_native.cpython-312-x86_64-linux-gnu.so
cp $SO $SP
D=/tmp/s45/runs/$TAG; rm -rf $D; mkdir -p $D
echo "start $(date +%T) $(uptime)" > $D/load
cd /tmp && /tmp/wt19venv/bin/python -m jax_flash.benchmark --platform cpu --seqs $SEQS --head-dims 64 128 --dtype $DT --skip xla --reps 5 --interleave --out $D > $D/stdout 2>&1
echo "end $(date +%T) $(uptime)" >> $D/load
ps aux --sort=-%cpu | awk 'NR<5{print $3, $11}' >> $D/load
