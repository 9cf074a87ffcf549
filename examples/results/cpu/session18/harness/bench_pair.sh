#!/bin/bash
# Session 18 (this machine): the benchmark of one build. usage: bench_pair.sh SO_NAME TAG DTYPE  -- swaps the module in, runs the benchmark, records load
set -e
SO=$1; TAG=$2; DT=${3:-float32}
cp /tmp/so19d/$SO.so /tmp/venv19d/lib/python3.11/site-packages/jax_flash/_native.cpython-311-x86_64-linux-gnu.so
OUT=/work/cpu19d/examples/results/cpu/session18
D=/tmp/so19d/out_$TAG; rm -rf $D; mkdir -p $D
echo "start $(date +%T) $(uptime)" > $OUT/$TAG.load
cd /tmp && /tmp/venv19d/bin/python -m jax_flash.benchmark --platform cpu --seqs 2048 4096 8192 --head-dims 64 128 --dtype $DT --skip xla --reps 3 --interleave --out $D > $D/stdout 2>&1
echo "end $(date +%T) $(uptime)" >> $OUT/$TAG.load
ls $D
