#!/bin/bash
# Session 13, GPU call 1: the small scripts' steady-state +40 MB, and the trial's whole-run peak against FP32's.
cd "$(dirname "$0")/.."
export PYTHONPATH=src OMP_NUM_THREADS=4
run() { echo "=== $*"; timeout 200 python3 scripts/graph_memory.py "$@" 2>&1 | grep -v Warning | tail -45; }
GRAPH_MEMORY_HISTORY=1 run gan anchor 8
GRAPH_MEMORY_HISTORY=1 run gan auto 12
GRAPH_MEMORY_HISTORY=1 run mlp anchor 8
GRAPH_MEMORY_HISTORY=1 run mlp auto 12
run resnet50 fp32 20
run resnet50 auto 40
run t5 fp32 20
run t5 auto 40
