#!/bin/bash
# Session 13, GPU call 3: the test suite at HEAD (compiled kernels, CUDA tests), then T5's trial peak against FP32's.
cd "$(dirname "$0")/.."
export PYTHONPATH=src
OMP_NUM_THREADS=2 timeout 400 python3 -m pytest -q -n 8 --timeout 300 -p no:logging tests 2>&1 | tail -25
export OMP_NUM_THREADS=4
for m in "t5 fp32 20" "t5 auto 20" "effnet auto 20"; do
  echo "=== $m"; timeout 150 python3 scripts/graph_memory.py $m 2>&1 | grep -v "Warning\|warn(" | head -8
done
