"""A random topological order of the main graph's nodes.

Exporters write nodes in the order the model's forward ran, which tells a reader which layer comes first; ONNX only
requires that every node come after the producers of what it reads. Kahn's algorithm with a random pick among the
ready nodes gives a valid order drawn from all of them. A node with a body (If/Loop/Scan) also waits for the
outer names its body reads.
"""
from __future__ import annotations

import numpy as np
import onnx

from automp.protect.names import implicit_inputs


def random_topological_order(graph: onnx.GraphProto, rng: np.random.Generator) -> list[int]:
    """Indices of graph.node in a random valid order; raises ValueError if the graph has a cycle."""
    nodes = list(graph.node)
    producer = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    users: list[list[int]] = [[] for _ in nodes]
    waiting = [0] * len(nodes)
    for k, n in enumerate(nodes):
        deps = {producer[t] for t in list(n.input) + implicit_inputs(n) if t in producer}
        deps.discard(k)
        waiting[k] = len(deps)
        for d in sorted(deps):
            users[d].append(k)
    ready = [k for k in range(len(nodes)) if waiting[k] == 0]
    order: list[int] = []
    while ready:
        j = int(rng.integers(len(ready)))
        ready[j], ready[-1] = ready[-1], ready[j]
        k = ready.pop()
        order.append(k)
        for u in users[k]:
            waiting[u] -= 1
            if waiting[u] == 0:
                ready.append(u)
    if len(order) != len(nodes):
        stuck = next(nodes[k] for k in range(len(nodes)) if waiting[k] > 0)
        raise ValueError(f"the graph has a cycle through node {stuck.name!r} (op {stuck.op_type}); not a valid ONNX "
                         "graph")
    return order


def shuffle(graph: onnx.GraphProto, rng: np.random.Generator) -> float:
    """Reorder graph.node in place; returns the fraction of nodes that moved."""
    order = random_topological_order(graph, rng)
    nodes = list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes[k] for k in order)
    return sum(k != i for i, k in enumerate(order)) / max(len(order), 1)
