"""Opaque names, and no exporter metadata.

Exporters name tensors and nodes after the module path ("encoder.layers.0.self_attn.q_proj.weight") and the
dynamo exporter adds per-node metadata (class hierarchy, stack traces, the FX node): together they are the model's
source code in outline. Every node, tensor and initializer gets a random name from one global map (names are
unique across the main graph and its bodies, so one map renames all scopes consistently). Graph input and output
names are kept unless rename_io: callers feed and read them by name (initializers also listed as graph inputs are
weights, not interface: they are renamed).

Stripping removes doc strings, metadata_props, value_info (intermediate shapes), the graph name and the producer
fields. Model-local functions are left as they are.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx

from automp.protect.names import graphs, tensor_names


@dataclass
class RenameResult:
    tensors: int = 0
    initializers: int = 0
    nodes: int = 0
    io_kept: list[str] = field(default_factory=list)
    io_renamed: dict[str, str] = field(default_factory=dict)


class _Names:
    def __init__(self, rng: np.random.Generator, taken: set[str]):
        self.rng, self.taken = rng, set(taken)

    def __call__(self) -> str:
        while True:
            name = "v" + self.rng.bytes(5).hex()
            if name not in self.taken:
                self.taken.add(name)
                return name


def rename(model: onnx.ModelProto, rng: np.random.Generator, rename_io: bool = False) -> RenameResult:
    """Rename in place."""
    g = model.graph
    inits = {t.name for sub in graphs(g) for t in sub.initializer}
    io = [v.name for v in g.input if v.name not in inits] + [v.name for v in g.output]  # weights are no interface
    keep = set() if rename_io else set(io)
    new = _Names(rng, set(tensor_names(g)) | {n.name for sub in graphs(g) for n in sub.node})
    mapping = {n: new() for n in tensor_names(g) if n not in keep}
    res = RenameResult(tensors=len(mapping), initializers=len(inits - keep))
    res.io_kept = list(dict.fromkeys(n for n in io if n in keep))
    res.io_renamed = {n: mapping[n] for n in dict.fromkeys(io) if n in mapping}

    def sub(name: str) -> str:
        return mapping.get(name, name) if name else name

    for gr in graphs(g):
        for v in list(gr.input) + list(gr.output) + list(gr.value_info) + list(gr.initializer):
            v.name = sub(v.name)
        for s in gr.sparse_initializer:
            s.values.name = sub(s.values.name)
            s.indices.name = sub(s.indices.name)
        for n in gr.node:
            n.input[:] = [sub(i) for i in n.input]
            n.output[:] = [sub(o) for o in n.output]
            n.name = new()
            res.nodes += 1
    return res


def strip_metadata(model: onnx.ModelProto, rng: np.random.Generator) -> None:
    """Remove what documents the model's origin (in place)."""
    model.doc_string = ""
    model.producer_name = model.producer_version = model.domain = ""
    model.model_version = 0
    del model.metadata_props[:]
    for gr in graphs(model.graph):
        gr.doc_string = ""
        gr.name = "g" + rng.bytes(4).hex()
        del gr.value_info[:]
        if hasattr(gr, "metadata_props"):
            del gr.metadata_props[:]
        for v in list(gr.input) + list(gr.output) + list(gr.initializer):
            v.doc_string = ""
            if hasattr(v, "metadata_props"):
                del v.metadata_props[:]
        for n in gr.node:
            n.doc_string = ""
            if hasattr(n, "metadata_props"):
                del n.metadata_props[:]
