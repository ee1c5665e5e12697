#!/bin/bash
# Session 13, GPU calls 1-2: the small scripts' steady-state memory and the trial's whole-run peak against FP32's.
cd "$(dirname "$0")/.."
export PYTHONPATH=src OMP_NUM_THREADS=4
run() { echo "=== $*"; timeout 240 python3 scripts/graph_memory.py "$@" 2>&1 | grep -v "Warning\|warn(" | tail -45; }
GRAPH_MEMORY_HISTORY=1 run gan auto 8
GRAPH_MEMORY_HISTORY=1 run mlp auto 8
run resnet50 auto 20
run t5 auto 20
