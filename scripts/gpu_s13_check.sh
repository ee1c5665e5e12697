#!/bin/bash
# Session 13, GPU call 4: the failed test and the trial tests, the siamese loop on the graphed path, T5's and
# EfficientNet's trial peak with FP32 leaving after one round.
cd "$(dirname "$0")/.."
export PYTHONPATH=src OMP_NUM_THREADS=4
timeout 90 python3 -m pytest -q -p no:logging tests/test_session_confirm.py tests/test_choose.py tests/test_allocator.py 2>&1 | tail -3
timeout 120 python3 scripts/graph_pool_check.py 2>&1 | grep -v "Warning\|warn("
for m in "t5 auto 20" "effnet auto 20"; do
  echo "=== $m"; timeout 170 python3 scripts/graph_memory.py $m > /tmp/gm.txt 2>&1; grep -v "Warning\|warn(" /tmp/gm.txt | head -9
done
