"""Sparsity: magnitude pruning (unstructured or 2:4) that stays pruned through training, and 2:4 weights on
sparse tensor cores where that measures faster.

    report = prune(model, SparsityConfig("2:4", layers="*.intermediate.dense"), evaluate=acc)   # one shot
    sched = SparsitySchedule(model, SparsityConfig("unstructured", 0.8), steps=1000, every=50)   # gradual
    ... train, calling sched.step() after optimizer.step() (zeros stay zero under automp.enable too) ...
    report = finalize(model, evaluate=acc)      # plain model, zeros in the weights (state_dict, ONNX keep them)
    choice = to_semi_structured(model.half().cuda(), (example,))   # per layer: sparse only where it is faster

masks.py holds the mask arithmetic, pruning.py the masks' life during training, schedule.py the gradual ramp,
semi_structured.py the GPU conversion and its measured per-layer choice, reconstruction.py the least-squares refit
of a pruned layer from calibration data, report.py the reports.
"""
from automp.compress.sparse.pruning import (SparsityConfig, apply_masks, finalize, get_masks, is_pruned, prune,
                                            select_layers, sparsity_report)
from automp.compress.sparse.reconstruction import refit
from automp.compress.sparse.report import LayerReport, SparsityReport
from automp.compress.sparse.schedule import SparsitySchedule
from automp.compress.sparse.semi_structured import (Backend, LayerChoice, SemiStructuredReport, detect_backend,
                                                    to_semi_structured)

__all__ = ["prune", "finalize", "apply_masks", "get_masks", "sparsity_report", "is_pruned", "select_layers",
           "SparsityConfig", "SparsitySchedule", "SparsityReport", "LayerReport", "refit", "to_semi_structured",
           "detect_backend", "Backend", "LayerChoice", "SemiStructuredReport"]
