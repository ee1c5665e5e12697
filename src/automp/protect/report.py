"""What `automp protect` did to a model, and what a reader of the protected file can still see.

The report is for the model's owner, not for shipping: it lists the input/output names it kept and, with rename_io,
how they were renamed.
"""
from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import onnx

from automp.files import atomic_output
from automp.protect.names import graphs

WEIGHT_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul", "Gather")


@dataclass
class ProtectReport:
    source: str
    nodes: dict[str, int]  # before, after (main graph), in_branches (nodes inside bodies after)
    ops_before: dict[str, int]  # over all graphs, bodies included
    ops_after: dict[str, int]
    renamed: dict[str, Any]
    scaled: dict[str, Any]
    split: dict[str, Any]
    inserted: dict[str, Any]
    shuffled: dict[str, Any]
    encrypted: dict[str, Any]
    metadata_stripped: bool
    error_vs_original: dict[str, Any]
    still_visible: dict[str, Any]
    bytes: dict[str, int]
    deterministic: bool  # a seed was given: the same seed, model and key give the same file
    transforms: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    output: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=float)

    def write(self, path: str | os.PathLike) -> None:
        """Atomically (files.atomic_output): a failed write leaves any existing report at `path` as it was."""
        text = self.to_json()
        with atomic_output(path) as tmp, open(tmp, "w") as f:
            f.write(text)

    def summary(self) -> list[str]:
        s, i = self.scaled, self.inserted
        err = self.error_vs_original
        lines = [f"nodes {self.nodes['before']} -> {self.nodes['after']} (+{self.nodes['in_branches']} inside "
                 f"branches); {self.renamed['tensors']} tensors and {self.renamed['nodes']} nodes renamed "
                 f"(kept: {', '.join(self.renamed['io_kept']) or 'none'})",
                 f"scaled {s['layers']} layers ({s['weights']} weights, {s['absorbed']} absorbed, "
                 f"{s['compensation_muls']} compensating Muls); split {self.split['split']} constants",
                 f"inserted {i['identity_spots']}/{i['identity_eligible']} identity spots, "
                 f"{i['branches']}/{i['branch_eligible']} branches; order shuffled: "
                 f"{self.shuffled.get('moved', 0):.0%} of nodes moved"]
        if self.encrypted:
            lines.append(f"encrypted {self.encrypted['tensors']} initializers ({self.encrypted['bytes']} bytes)")
        if "rel_l2" in err:
            lines.append(f"max rel. error vs original: {max(err['rel_l2'].values(), default=0):.2e} "
                         f"({err['inputs']})")
        else:
            lines.append(f"not verified: {err.get('skipped')}")
        return lines


def op_histogram(model: onnx.ModelProto) -> dict[str, int]:
    return dict(sorted(Counter(n.op_type for g in graphs(model.graph) for n in g.node).items()))


def _io(values, inits: set[str]) -> list[dict[str, Any]]:
    out = []
    for v in values:
        if v.name in inits:
            continue
        t = v.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in t.shape.dim]
        out.append({"name": v.name, "type": onnx.TensorProto.DataType.Name(t.elem_type), "shape": shape})
    return out


def still_visible(model: onnx.ModelProto, encrypted: bool, inserted: bool) -> dict[str, Any]:
    """What the protected (unencrypted) model shows anyone who opens it."""
    inits = {t.name: t for g in graphs(model.graph) for t in g.initializer}
    layers = {(n.op_type, i) for g in graphs(model.graph) for n in g.node if n.op_type in WEIGHT_OPS
              for i in n.input[:2] if i in inits}
    counts = Counter(op for op, _ in layers)
    notes = [
        "graph input/output names, types and shapes (the model's interface)",
        "the op types: which activations and normalisations the model uses",
        f"{len(layers)} weight layers ({dict(counts)}) and so the depth of the model",
        "the weight shapes, i.e. the layer widths" + (" (hidden in the file while encrypted; visible to anyone "
                                                      "holding the key)" if encrypted else ""),
        "anyone who can run the model can still query it (distillation, model extraction)",
        "constant folding (onnx-simplifier, onnxruntime at load time) adds the split constants back together"
        + (", evaluates the opaque branch conditions and removes the identity ops" if inserted else ""),
        "a compensating Mul next to a scaled layer reveals that layer's scale; scales absorbed by the next "
        "layer are not undone by folding",
    ]
    return {"inputs": _io(model.graph.input, set(inits)), "outputs": _io(model.graph.output, set()),
            "opset": {o.domain or "ai.onnx": o.version for o in model.opset_import},
            "weight_layers": dict(counts), "layer_count": len(layers),
            "parameters": int(sum(_numel(t) for t in inits.values() if t.data_type in (1, 10, 11, 16))),
            "notes": notes}


def _numel(t: onnx.TensorProto) -> int:
    n = 1
    for d in t.dims:
        n *= d
    return n
