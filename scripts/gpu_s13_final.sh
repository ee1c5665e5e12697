#!/bin/bash
# Session 13, last GPU call: the test suite at HEAD (written to a file: xdist workers outlive a timeout on a pipe),
# then automp bf16 vs fp16 on ResNet-50 with the anchor, as far as the call's time goes.
cd "$(dirname "$0")/.."
export PYTHONPATH=src
OUT=${OUT:-/tmp}
OMP_NUM_THREADS=2 timeout -k 5 400 python3 -m pytest -q -n 8 --timeout 300 -p no:logging tests > $OUT/tests.txt 2>&1
tail -4 $OUT/tests.txt; grep "^FAILED\|^ERROR" $OUT/tests.txt
mkdir -p $OUT/r50
OMP_NUM_THREADS=4 timeout -k 5 $((575 - SECONDS)) python3 -m automp bench zoo --models resnet50 \
  --modes automp-bf16,automp-fp16 --steps 15 --mode-timeout 70 --out $OUT/r50 2>&1 | grep -v "Warning\|warn(" \
  > $OUT/r50/log.txt
grep "^\[resnet50\]\|runs " $OUT/r50/log.txt | cut -c1-300
