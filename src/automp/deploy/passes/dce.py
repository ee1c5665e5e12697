"""Dead-code elimination: keep only nodes and initializers from which a graph output can be reached.

Other passes leave orphans behind on purpose (a folded BatchNormalization's statistics, a weight that was
rewritten under a new name), so one sweep at the end is simpler than each pass cleaning up after itself.
Graph inputs are never removed: the optimized model keeps the caller's input signature.
"""
from __future__ import annotations

import onnx

from automp.deploy.passes.graph import Graph, copy_model


def dce(model: onnx.ModelProto) -> onnx.ModelProto:
    out = copy_model(model)
    g = Graph(out)
    live: set[str] = set(g.graph_outputs) | g.nested
    keep: list[onnx.NodeProto] = []
    for node in reversed(list(out.graph.node)):
        if any(o in live for o in node.output if o):
            keep.append(node)
            live.update(i for i in node.input if i)
    keep.reverse()
    del out.graph.node[:]
    out.graph.node.extend(keep)
    inits = [t for t in out.graph.initializer if t.name in live]
    del out.graph.initializer[:]
    out.graph.initializer.extend(inits)
    produced = {o for n in keep for o in n.output} | set(g.graph_inputs)
    infos = [vi for vi in out.graph.value_info if vi.name in produced]
    del out.graph.value_info[:]
    out.graph.value_info.extend(infos)
    return out
