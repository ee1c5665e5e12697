"""ONNX in and out: the deployment IR is an onnx.ModelProto, whichever way the model arrives.

A model is accepted only if onnxruntime's CPU provider can run it, because that is the promise the optimizer makes
about its output; the checks run in the order that gives the most precise message (decode -> op registry ->
checker -> shape inference -> onnxruntime session), and each error names the file and the node or op at fault.
"""
from __future__ import annotations

import logging
import os
import re
import warnings
from typing import Iterable, Iterator, Sequence

import onnx

from automp import files
from automp.deploy import runtime
from automp.files import atomic_output

PathLike = str | os.PathLike
EXTERNAL_DATA_BYTES = 1_800_000_000  # a serialized model past this (protobuf's limit is 2 GB) gets a side file

_DEFAULT_DOMAINS = ("", "ai.onnx", "ai.onnx.ml")


class UnsupportedOpError(NotImplementedError):
    """The model uses an op (or an op/type combination) that onnxruntime's CPU provider cannot run."""


def _source_name(src) -> str:
    return os.fspath(src) if isinstance(src, (str, os.PathLike)) else "<bytes>"


def _node_label(node: onnx.NodeProto, index: int) -> str:
    op = f"{node.domain}:{node.op_type}" if node.domain else node.op_type
    return f"node {node.name or f'#{index}'!r} (op {op})"


def _check_registry(model: onnx.ModelProto, name: str) -> None:
    opsets = {o.domain or "": o.version for o in model.opset_import}
    for k, node in enumerate(model.graph.node):
        dom = node.domain or ""
        if dom not in _DEFAULT_DOMAINS:
            continue  # contrib domains: only onnxruntime knows, checked when the session is built
        version = opsets.get(dom, opsets.get("ai.onnx", 0)) if dom != "ai.onnx.ml" else opsets.get(dom, 1)
        try:
            onnx.defs.get_schema(node.op_type, version, dom)
        except onnx.defs.SchemaError:
            raise UnsupportedOpError(f"{name}: {_node_label(node, k)} is not an ONNX operator at opset {version}; "
                                     "onnxruntime cannot run it") from None


def _blame(model: onnx.ModelProto, message: str) -> str:
    """The node an onnxruntime error message is about (by name, else by op type), as a label."""
    for k, node in enumerate(model.graph.node):
        if node.name and re.search(rf"[\s(\"'`]{re.escape(node.name)}[\s)\"',`]", message):
            return _node_label(node, k)
    for k, node in enumerate(model.graph.node):
        if re.search(rf"\b{re.escape(node.op_type)}\b", message):
            return _node_label(node, k)
    return "the model"


def checked_session(model: onnx.ModelProto, name: str = "<model>", optimize: bool = True):
    """An onnxruntime CPU session, or an error that names the node onnxruntime could not handle."""
    try:
        return runtime.session(model, "cpu", optimize=optimize)
    except Exception as e:  # noqa: BLE001 — onnxruntime raises its own exception types; re-raise with context
        msg = str(e)
        where = _blame(model, msg)
        unsupported = ("not a registered function/op", "No Op registered", "Could not find an implementation",
                       "is invalid", "NOT_IMPLEMENTED")
        cls = UnsupportedOpError if any(s in msg for s in unsupported) else ValueError
        raise cls(f"{name}: onnxruntime (CPUExecutionProvider) cannot run {where}: {msg}") from None


def validate(model: onnx.ModelProto, name: str = "<model>", check_runtime: bool = True) -> onnx.ModelProto:
    """Raise ValueError/UnsupportedOpError naming the problem; return the model unchanged when it is usable."""
    if not model.HasField("graph") or not model.graph.output:
        raise ValueError(f"{name}: not an ONNX model (no graph or no graph outputs)")
    _check_registry(model, name)
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as e:
        raise ValueError(f"{name}: invalid ONNX model: {e}") from None
    try:
        onnx.shape_inference.infer_shapes(model, strict_mode=True)
    except Exception as e:  # noqa: BLE001 — onnx raises InferenceError or RuntimeError depending on version
        raise ValueError(f"{name}: ONNX shape inference fails: {e}") from None
    if check_runtime:
        checked_session(model, name, optimize=False)
    return model


def load(src: str | os.PathLike | bytes, check_runtime: bool = True) -> onnx.ModelProto:
    name = _source_name(src)
    if not isinstance(src, (bytes, bytearray)) and not os.path.isfile(src):
        raise FileNotFoundError(f"{name}: no such ONNX file")
    try:
        model = onnx.load_model_from_string(bytes(src)) if isinstance(src, (bytes, bytearray)) else onnx.load(src)
    except Exception as e:  # noqa: BLE001 — protobuf DecodeError, or missing external data
        raise ValueError(f"{name}: not a readable ONNX file ({type(e).__name__}: {e})") from None
    return validate(model, name, check_runtime)


def fit_ir_version(model: onnx.ModelProto, floor: int = 0) -> onnx.ModelProto:
    """Set the model's IR version to the lowest that holds its opsets, or to `floor` (the input model's) if that is
    higher; returns the model. onnx >= 1.23 stamps its own newest IR version (14) on what it builds, which
    onnxruntime <= 1.30 refuses to load, although an opset-17 model needs only IR 8."""
    need = onnx.helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
    model.ir_version = max(need, floor)
    return model


def saved_data_file(path: PathLike) -> str:
    """The side file save() writes the weights of a model past EXTERNAL_DATA_BYTES to: `<path>.data` beside the
    file `path` resolves to (atomic_output writes through a symlink)."""
    return os.path.realpath(path) + ".data"


def _tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every tensor stored in a graph: initializers, sparse ones, and tensor attributes, bodies included."""
    yield from graph.initializer
    for sp in graph.sparse_initializer:
        yield from (sp.values, sp.indices)
    for node in graph.node:
        yield from _attribute_tensors(node)


def _attribute_tensors(node: onnx.NodeProto) -> Iterator[onnx.TensorProto]:
    for a in node.attribute:
        if a.HasField("t"):
            yield a.t
        yield from a.tensors
        if a.HasField("sparse_tensor"):
            yield from (a.sparse_tensor.values, a.sparse_tensor.indices)
        for sp in a.sparse_tensors:
            yield from (sp.values, sp.indices)
        if a.HasField("g"):
            yield from _tensors(a.g)
        for g in a.graphs:
            yield from _tensors(g)


def _model_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    graphs = [model.graph] + [g for ti in model.training_info for g in (ti.initialization, ti.algorithm)]
    for g in graphs:
        yield from _tensors(g)
    for f in model.functions:
        for n in f.node:
            yield from _attribute_tensors(n)


def _inline_again(model: onnx.ModelProto, data_file: str) -> None:
    """Undo what onnx.save_model(save_as_external_data=True) does to the caller's model in place (tensors left
    pointing at `data_file`, their bytes dropped): read the bytes back from the file just written."""
    folder, name = os.path.split(data_file)
    for t in _model_tensors(model):
        if t.data_location == onnx.TensorProto.EXTERNAL and \
                any(e.key == "location" and e.value == name for e in t.external_data):
            if not t.HasField("raw_data"):  # else marked, not yet written (a write that failed part-way)
                onnx.external_data_helper.load_external_data_for_tensor(t, folder)
            t.ClearField("data_location")
            del t.external_data[:]


def external_data_files(path: PathLike) -> list[str]:
    """The external-data files the ONNX model at `path` references, each tensor's `location` joined to the model's
    folder (where onnx.load looks), in order and without repeats; the data itself is not read. [] for a model without
    external data, or one that does not parse (loading it reports that)."""
    try:
        model = onnx.load(os.fspath(path), load_external_data=False)
    except Exception:  # noqa: BLE001 — not a model: load() names the problem when the work starts
        return []
    folder = os.path.dirname(os.path.abspath(path))
    found: dict[str, None] = {}
    for t in _model_tensors(model):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            loc = next((e.value for e in t.external_data if e.key == "location"), "")
            if loc:
                found.setdefault(os.path.normpath(os.path.join(folder, loc)), None)
    return list(found)


def input_files(path: PathLike) -> dict[str, str]:
    """Every file that reading the ONNX model at `path` reads, as description -> path: the model and each
    external-data file it references. No output may be, or be written over, any of them."""
    out = {"the input model": os.fspath(path)}
    folder = os.path.dirname(os.path.abspath(path))
    for f in external_data_files(path):
        out[f"the input model's external data file {os.path.relpath(f, folder)!r} (its weights)"] = f
    return out


def check_outputs(outputs: dict[str, PathLike | None], model: PathLike,
                  inputs: dict[str, PathLike | None] | None = None, model_output: str = "-o") -> dict[str, str]:
    """The check the optimize and protect CLIs make before any work: every output (flag -> path) can be written, and
    none is, or would be written over, a file the input model reads (input_files), another input (description ->
    path) or another output. The model output `outputs[model_output]` is also checked for the side file
    (saved_data_file) that save() writes for a model past protobuf's limit: whether the result will need one is not
    known before the work, so that name must be free of inputs and other outputs too. A ValueError names the flag
    and the file. Returns input_files(model), for save(keep=...)."""
    model_files = input_files(model)
    reads = {**model_files, **(inputs or {})}
    files.check_outputs(outputs, reads)
    out = outputs.get(model_output)
    if out is None:
        return model_files
    side = saved_data_file(out)
    clash = [(what, src) for what, src in reads.items() if src is not None and files.same_file(side, src)]
    clash += [(f"the {flag} output", path) for flag, path in outputs.items()
              if flag != model_output and path is not None and files.same_file(side, path)]
    if clash:
        raise ValueError(f"{model_output} {os.fspath(out)} would put its external data (a model past "
                         f"{EXTERNAL_DATA_BYTES / 1e9:.1f} GB) in {side}, which is {clash[0][0]}; refusing to "
                         "overwrite it (write elsewhere)")
    return model_files


def save(model: onnx.ModelProto, path: PathLike, keep: Iterable[PathLike] = ()) -> None:
    """Weights go to a side file (saved_data_file) only past protobuf's 2 GB limit; small models stay one
    self-contained file. Written atomically (files.atomic_output): a failed write leaves any existing file at `path`
    as it was; `model` is left as it was (onnx's writer moves the weights of a big one out of it). `keep`: files that
    must survive (the input model and its external data: input_files); a ValueError, with nothing written, if `path`
    or the side file this write needs is one of them."""
    keep = list(keep)
    big = model.ByteSize() > EXTERNAL_DATA_BYTES
    targets = [os.fspath(path)] + ([saved_data_file(path)] if big else [])
    for target in targets:
        for k in keep:
            if files.same_file(target, k):
                raise ValueError(f"writing {os.fspath(path)} would write {target}, which the input model reads "
                                 f"({os.fspath(k)}); refusing to overwrite it (write elsewhere)")
    with atomic_output(path) as tmp:
        try:
            onnx.save_model(model, tmp, save_as_external_data=big,
                            location=os.path.basename(tmp) + ".data" if big else None)
        finally:
            if big:
                _inline_again(model, tmp + ".data")


def _rename(model: onnx.ModelProto, old: str, new: str) -> None:
    """Rename tensor `old` to `new` everywhere in the main graph, first moving any other tensor called `new`."""
    if old == new:
        return
    g = model.graph
    taken = {n for node in g.node for n in list(node.input) + list(node.output)} | \
        {t.name for t in g.initializer} | {v.name for v in list(g.input) + list(g.output)}
    if new in taken:
        k = 0
        while f"{new}_{k}" in taken:
            k += 1
        _rename(model, new, f"{new}_{k}")
    for node in g.node:
        node.input[:] = [new if i == old else i for i in node.input]
        node.output[:] = [new if o == old else o for o in node.output]
    for v in list(g.input) + list(g.output) + list(g.value_info) + list(g.initializer):
        if v.name == old:
            v.name = new


def export_torch(module, example_inputs: Sequence, input_names: Sequence[str] | None = None,
                 output_names: Sequence[str] | None = None, dynamic_batch: bool = True, opset: int = 18,
                 exporter: str = "auto") -> onnx.ModelProto:
    """Export an nn.Module (in eval mode) to ONNX with named inputs/outputs and a symbolic batch axis.

    exporter: dynamo (torch.export based, torch >= 2.9 default), legacy (TorchScript), or auto = dynamo with the
    legacy exporter as fallback, since dynamo export still rejects some models that trace fine.
    """
    import torch

    if exporter not in ("auto", "dynamo", "legacy"):
        raise ValueError(f"exporter must be auto, dynamo or legacy, got {exporter!r}")
    if opset < 17:
        raise ValueError(f"opset {opset} < 17: LayerNormalization needs opset 17")
    args = tuple(example_inputs)
    ins = list(input_names or [f"input_{k}" for k in range(len(args))])
    module = module.eval()
    errors = []
    if exporter in ("auto", "dynamo"):
        try:
            dyn = None
            if dynamic_batch:
                batch = torch.export.Dim("batch")
                dyn = tuple({0: batch} if isinstance(a, torch.Tensor) and a.dim() > 0 else None for a in args)
            # "torchvision is not installed", constant-folding notes: the exporter's chatter, not the user's problem
            quiet = [logging.getLogger(n) for n in ("torch.onnx", "onnxscript")]
            levels = [q.level for q in quiet]
            for q in quiet:
                q.setLevel(logging.ERROR)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    prog = torch.onnx.export(module, args, dynamo=True, dynamic_shapes=dyn, opset_version=opset,
                                             verbose=False)
            finally:
                for q, lvl in zip(quiet, levels):
                    q.setLevel(lvl)
            # naming is done here, not by the exporter: its renaming can collide with an internal value of the
            # same name (seen with output "embedding" on a BERT) and produce a non-SSA graph
            model = prog.model_proto
            for vi, new in zip(list(model.graph.input), ins):
                _rename(model, vi.name, new)
            for vi, new in zip(list(model.graph.output), output_names or []):
                _rename(model, vi.name, new)
            return validate(fit_ir_version(model), f"<export of {type(module).__name__}>")
        except Exception as e:  # noqa: BLE001 — fall back below, and report both failures if that fails too
            if exporter == "dynamo":
                raise
            errors.append(f"dynamo: {type(e).__name__}: {e}")
    import io
    buf = io.BytesIO()
    outs = list(output_names) if output_names else None
    axes = None
    if dynamic_batch:
        axes = {n: {0: "batch"} for n in ins}
        axes.update({n: {0: "batch"} for n in outs or []})
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(module, args, buf, dynamo=False, input_names=ins, output_names=outs,
                              dynamic_axes=axes, opset_version=opset)
    except Exception as e:
        errors.append(f"legacy: {type(e).__name__}: {e}")
        raise RuntimeError(f"cannot export {type(module).__name__} to ONNX: " + " | ".join(errors)) from None
    return validate(fit_ir_version(onnx.load_model_from_string(buf.getvalue())), f"<export of {type(module).__name__}>")
