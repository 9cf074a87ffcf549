#!/bin/bash
# bench.sh TAG DTYPE [extra args] -- the benchmark on the CPU beside torch, load recorded
TAG=$1; DT=$2; shift 2
D=/tmp/s50cpu/runs/$TAG; rm -rf $D; mkdir -p $D
echo "start $(date +%T) $(uptime)" > $D/load
cd /tmp && PYTHONPATH=/tmp/cpupkg /tmp/cpuvenv/bin/python -m jax_flash.benchmark --platform cpu --seqs 2048 4096 8192 --head-dims 64 128 --dtype $DT --skip xla --reps 3 --interleave --out $D "$@" > $D/stdout 2>&1
echo "end $(date +%T) $(uptime)" >> $D/load
ps aux --sort=-%cpu | awk 'NR<5{print $3, $11}' >> $D/load
