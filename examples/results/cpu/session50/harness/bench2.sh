#!/bin/bash
# bench2.sh TAG DTYPE KEYBLOCKS -- the benchmark with the new module, JAX_FLASH_CPU_BWD_KEY_BLOCKS set
TAG=$1; DT=$2; N=$3; shift 3
D=/tmp/s50cpu/runs/$TAG; rm -rf $D; mkdir -p $D
echo "start $(date +%T) $(uptime) JAX_FLASH_CPU_BWD_KEY_BLOCKS=$N" > $D/load
cd /tmp && JAX_FLASH_CPU_BWD_KEY_BLOCKS=$N PYTHONPATH=/tmp/cpupkg_pf1 /tmp/cpuvenv/bin/python -m jax_flash.benchmark --platform cpu --seqs 2048 4096 8192 --head-dims 64 128 --dtype $DT --skip xla --reps 3 --interleave --out $D "$@" > $D/stdout 2>&1
echo "end $(date +%T) $(uptime)" >> $D/load
ps aux --sort=-%cpu | awk 'NR<5{print $3, $11}' >> $D/load
