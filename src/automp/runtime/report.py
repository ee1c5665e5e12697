"""The precision report: every node's dtype and the reason, as JSON (schema in DESIGN.md) and as a terminal table.

A tool that silently changes numerics is not trusted; one that says, node by node, what it did and why is.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from automp.precision.paint import Plan

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
                torch.float64: "float64"}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


_NOTICED: set[str] = set()  # the notices this process has written


def notice(message: str) -> None:
    """Tell the user something, in one line on stderr, `automp: ...`, once per process for each message: what a
    Python warning would say, without its file, line and source line, which point into automp, not the script."""
    line = " ".join(message.split())
    line = line if line.startswith("automp") else f"automp: {line}"
    if line not in _NOTICED:
        _NOTICED.add(line)
        print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def notices_from_warnings() -> Iterator[None]:
    """Around the runtime's calls into automp's libraries (calibration, FP8 timing tables), which warn as libraries
    do: their `automp: ...` warnings become notices; any other warning goes on as it was raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        if str(w.message).startswith("automp:"):
            notice(str(w.message))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


def precision_of(path: str, low: str) -> str:
    """The precision a call on `path` (a Route's value, or "as-written") computed in; `low`: the run's low dtype as
    the caller names it ("bf16", "bfloat16")."""
    return {"fp32-eager": "FP32", "as-written": "as written"}.get(path, "FP8" if path.startswith("fp8-") else low)


def calls_in_words(calls: dict[str, int] | None, low: str) -> str:
    """A phase's calls (a choice's "calls" entry) by precision, low precision first: "12 calls bf16, 6 FP32"; ""
    when there were none."""
    by: dict[str, int] = {}
    for path, n in (calls or {}).items():
        precision = precision_of(path, low)
        by[precision] = by.get(precision, 0) + n
    order = [low, "FP8", "FP32", "as written"]
    items = sorted(by.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order))
    return ", ".join(f"{n} calls {p}" if i == 0 else f"{n} {p}" for i, (p, n) in enumerate(items))


@dataclass
class Recorder:
    """Collects one entry per compiled graph; the launcher and enable() write it out."""

    device: str = "cpu"
    dtype: str = "bfloat16"
    graphs: list[dict[str, Any]] = field(default_factory=list)
    fallbacks: list[dict[str, str]] = field(default_factory=list)
    loss_scale: dict[str, Any] = field(default_factory=lambda: {"scale": 1.0, "overflow_steps": 0, "steps": 0})
    choices: list[dict[str, Any]] = field(default_factory=list)  # per root module: the path it runs and why
    compiles: dict[str, int] = field(default_factory=dict)  # per root module: graphs compiled (recompiles included)
    # per root module and stock path: seconds compiling and cache hits (automp.runtime.compile_log)
    compile_times: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    optimizers: list[dict[str, Any]] = field(default_factory=list)  # optimizers automp switched to fused
    # per root module: {"detached": output fields its compiled graphs detach because the script did not read them,
    # "reattached": why that stopped, if it did} (automp.runtime.guards.unread_outputs)
    unread_outputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    # process-wide settings automp measured and chose: {"setting", "value", "reason", ...}
    # (automp.runtime.tuning.conv_tuning)
    settings: list[dict[str, Any]] = field(default_factory=list)
    # per root module under dtype="fp8": each linear layer's LayerChoice and the counts per rule
    # (automp.runtime.fp8_layers); fp8_fallback: the loss divergence that took the run back to bf16, if one did
    fp8: dict[str, dict[str, Any]] = field(default_factory=dict)
    fp8_fallback: dict[str, Any] | None = None
    # per root module: its calls by phase ("trial": while its paths were timed, the re-measurement included;
    # "chosen": on its verdict) and by the path each call really ran (count_call); reported in its choice
    calls: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    # graph rewrites on the compiled paths, one entry per site: {"module", "rule", ...} with the site's own keys
    # ("mask", "calls", "shape": automp.precision.causal_mask; "weights", "widths": automp.precision.siblings;
    # "weight", "vocab": automp.precision.linear_ce)
    rewrites: list[dict[str, Any]] = field(default_factory=list)

    def add_plan(self, name: str, plan: Plan, casts_by_part: dict[str, dict[str, int]]) -> None:
        """One graph entry per part (forward/backward/inference); each node's "dtype" is its compute dtype,
        "storage" the dtype it has in memory, "rule" the Rule's name (what tools should key on), "reason" for
        people."""
        parts: dict[str, list[dict[str, str]]] = {}
        for node, d in plan.decisions.items():
            parts.setdefault(d.part, []).append(
                {"name": node.name, "op": d.op, "dtype": dtype_name(d.compute), "storage": dtype_name(d.storage),
                 "rule": d.rule.name, "reason": d.reason})
        for kind in ("forward", "backward", "inference"):
            if kind in parts:
                self.graphs.append({"name": f"{name}.{kind}", "kind": kind, "nodes": parts[kind],
                                    "casts": casts_by_part.get(kind, {"inserted": 0, "eliminated": 0,
                                                                      "remaining": 0})})

    def add_choice(self, module: str, verdict: dict[str, Any] | None, why: str) -> None:
        """How a root module runs: a verdict (path, timings, cached or not), or None when automp stepped aside and
        the module runs as the script wrote it. A later choice for the same module replaces the earlier one."""
        self.choices = [c for c in self.choices if c["module"] != module]
        entry = dict(verdict) if verdict else {"path": "as-written", "timings_ms": {}, "cached": False}
        self.choices.append({"module": module, **entry, "reason": why})

    def count_call(self, module: str, phase: str, path: str) -> None:
        """One call of a root module, in `phase` ("trial" or "chosen"), that ran `path` (a Route's value, or
        "as-written")."""
        counts = self.calls.setdefault(module, {}).setdefault(phase, {})
        counts[path] = counts.get(path, 0) + 1

    def add_setting(self, entry: dict[str, Any]) -> None:
        """A later entry for the same setting replaces the earlier one."""
        self.settings = [e for e in self.settings if e["setting"] != entry["setting"]] + [entry]

    def add_rewrite(self, module: str, rule: str, **site: Any) -> None:
        """A graph rewrite at one site of a module's compiled graph; the same site compiled again is listed once."""
        entry = {"module": module, "rule": rule, **site}
        if entry not in self.rewrites:
            self.rewrites.append(entry)

    def add_fallback(self, where: str, why: str, rule: str | None = None) -> None:
        """`rule`: what tools key on (automp.runtime.decisions names the runtime's); the precision pass's own
        fallbacks (a graph that failed to compile) carry none."""
        self.fallbacks.append({"where": where, "reason": why, **({"rule": rule} if rule else {})})

    def as_dict(self) -> dict[str, Any]:
        choices = [{**c, "calls": {phase: dict(n) for phase, n in self.calls[c["module"]].items()}}
                   if c["module"] in self.calls else c for c in self.choices]
        return {"device": self.device, "dtype": self.dtype, "graphs": self.graphs, "loss_scale": self.loss_scale,
                "fallbacks": self.fallbacks, "choices": choices, "compiles": self.compiles,
                "compile_times": self.compile_times,
                "optimizers": self.optimizers, "unread_outputs": self.unread_outputs, "settings": self.settings,
                "fp8": self.fp8, "fp8_fallback": self.fp8_fallback, "rewrites": self.rewrites}

    def save(self, path: str) -> None:
        from automp.files import atomic_output
        with atomic_output(path) as tmp, open(tmp, "w") as f:
            json.dump(self.as_dict(), f, indent=1)


_GRAPH_KEYS = ("name", "kind", "nodes", "casts")
_NODE_KEYS = ("name", "op", "dtype", "reason")
_CAST_KEYS = ("inserted", "eliminated", "remaining")


def _require(ok: bool, problem: str) -> None:
    if not ok:
        raise ValueError(problem)


def _check_entries(items: Any, where: str, keys: tuple[str, ...], strings: tuple[str, ...] = ()) -> None:
    """items is a list of objects that have every one of keys, those in strings with string values (the table
    renders them as text)."""
    _require(isinstance(items, list), f"{where} is not a list")
    for i, item in enumerate(items):
        ok = isinstance(item, dict) and all(k in item for k in keys) and all(isinstance(item[k], str) for k in strings)
        _require(ok, f"{where}[{i}] is not an object with keys {', '.join(keys)}"
                     + (f" ({', '.join(strings)} strings)" if strings else ""))


def compile_in_words(path: str, t: dict[str, float]) -> str:
    """One path's compile log (automp.runtime.compile_log) as a phrase."""
    hits = [f"{int(t[k])} {name} cache hit(s)" for k, name in (("aot_cache_hits", "AOTAutograd"),
                                                              ("fx_cache_hits", "FX graph")) if t.get(k)]
    return (f"{path} {t.get('backend_s', 0) + t.get('backward_s', 0):.1f} s over {int(t.get('graphs', 0))} graph(s)"
            + (f" ({', '.join(hits)})" if hits else ""))


def check_report(report: Any) -> None:
    """Raise ValueError naming the first part of `report` that is not what summarize and print_report read. A saved
    file can hold anything (another tool's JSON, a hand-edited or truncated report), and a KeyError from deep in the
    printing would not say which part is wrong."""
    _require(isinstance(report, dict), f"its top level is a JSON {type(report).__name__}, not an object")
    for key in ("device", "dtype", "graphs"):
        _require(key in report, f"no {key!r} key")
    _check_entries(report["graphs"], "graphs", _GRAPH_KEYS, strings=("name", "kind"))
    for i, g in enumerate(report["graphs"]):
        _check_entries(g["nodes"], f"graphs[{i}].nodes", _NODE_KEYS, strings=_NODE_KEYS)
        _require(isinstance(g["casts"], dict) and all(k in g["casts"] for k in _CAST_KEYS),
                 f"graphs[{i}].casts is not an object with keys {', '.join(_CAST_KEYS)}")
    for key in ("loss_scale", "compiles", "compile_times"):
        _require(isinstance(report.get(key, {}), dict), f"{key} is not an object")
    _check_entries(report.get("fallbacks", []), "fallbacks", ("where", "reason"))
    _check_entries(report.get("choices", []), "choices", ("module", "path", "reason"), strings=("module",))
    for i, c in enumerate(report.get("choices", [])):
        calls = c.get("calls", {})
        _require(isinstance(calls, dict) and all(
            isinstance(n, dict) and all(isinstance(p, str) and isinstance(k, int) for p, k in n.items())
            for n in calls.values()), f"choices[{i}].calls is not an object of call counts by phase and path")
    _check_entries(report.get("optimizers", []), "optimizers", ("optimizer", "change"))
    _check_entries(report.get("settings", []), "settings", ("setting", "value", "reason"))
    unread = report.get("unread_outputs", {})
    _require(isinstance(unread, dict), "unread_outputs is not an object")
    for module, u in unread.items():
        where = f"unread_outputs[{module!r}]"
        _require(isinstance(u, dict), f"{where} is not an object")
        detached = u.get("detached", [])
        _require(isinstance(detached, list) and all(isinstance(d, str) for d in detached),
                 f"{where}.detached is not a list of strings")


def _kept_fp32_for_lack_of_support(node: dict[str, Any]) -> bool:
    """By the decision's rule; reports written before rules existed are read by their reason text."""
    if "rule" in node:
        return node["rule"] in ("UNKNOWN_OP", "NO_LOW_KERNEL")
    return node["reason"].startswith(("unknown op", "no low-precision"))


def summarize(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per graph: node counts by dtype, cast counts, and the unknown ops that were kept FP32. A malformed report is
    a ValueError naming the part at fault (check_report)."""
    check_report(report)
    rows = []
    for g in report["graphs"]:
        by_dtype = Counter(n["dtype"] for n in g["nodes"])
        unknown = sorted({n["op"] for n in g["nodes"] if _kept_fp32_for_lack_of_support(n)})
        rows.append({"graph": g["name"], "kind": g["kind"], "nodes": len(g["nodes"]), "by_dtype": dict(by_dtype),
                     "casts": g["casts"], "unknown": unknown})
    return rows


def print_report(report: dict[str, Any], show_nodes: bool = False) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    def e(value: Any) -> str:  # a value read from the report, shown as text: "[/x]" in it is not rich markup
        return escape(str(value))

    console = Console()
    if not report.get("graphs"):  # every module ran eagerly (its measured winner, or automp stepped aside)
        console.print(f"automp precision report — {e(report['dtype'])} on {e(report['device'])}: no graph went "
                      f"through automp's precision pass (each module's path and why: below)")
    t = Table(title=f"automp precision report — {e(report['dtype'])} on {e(report['device'])}")
    for col in ("graph", "nodes", "low", "fp32", "casts +/-/=", "kept FP32 (unknown/unsupported)"):
        t.add_column(col)
    for r in summarize(report):
        low = sum(v for k, v in r["by_dtype"].items() if k in ("float16", "bfloat16"))
        c = r["casts"]
        t.add_row(e(r["graph"]), str(r["nodes"]), str(low), str(r["by_dtype"].get("float32", 0)),
                  e(f"{c['inserted']}/{c['eliminated']}/{c['remaining']}"), e(", ".join(r["unknown"]) or "-"))
    if report.get("graphs"):
        console.print(t)
    ls = report.get("loss_scale", {})
    console.print(e(f"loss scale: {ls.get('scale')}  steps: {ls.get('steps')}  overflow steps: "
                    f"{ls.get('overflow_steps')}"))
    compiles = report.get("compiles", {})
    for c in report.get("choices", []):
        graphs = f", {e(compiles[c['module']])} graph(s) compiled" if c["module"] in compiles else ""
        cached = " (verdict from cache)" if c.get("cached") else ""
        calls = "; ".join(f"{phase}: {calls_in_words(n, str(report['dtype']))}"
                          for phase, n in (c.get("calls") or {}).items() if n)
        console.print(f"[cyan]{e(c['module'])}[/cyan] runs [bold]{e(c['path'])}[/bold]{cached}{graphs}"
                      + (f" ({e(calls)})" if calls else "") + f": {e(c['reason'])}")
    for module, paths in report.get("compile_times", {}).items():
        console.print(f"[cyan]{e(module)}[/cyan] compiling: " + "; ".join(e(compile_in_words(p, t))
                                                                         for p, t in paths.items()))
    for o in report.get("optimizers", []):
        console.print(f"[cyan]{e(o['optimizer'])}[/cyan]: {e(o['change'])}")
    for s in report.get("settings", []):
        console.print(f"[cyan]{e(s['setting'])}[/cyan] = {e(s['value'])}: {e(s['reason'])}")
    for module, u in report.get("unread_outputs", {}).items():
        if u.get("detached"):
            how = " (guessed before any call was seen: a language model given labels)" if u.get("guessed") else ""
            console.print(f"[cyan]{e(module)}[/cyan]: output fields the script does not read are detached in its "
                          f"compiled graphs (no zero gradient of their size){how}: {e(', '.join(u['detached']))}")
        if u.get("reattached"):
            console.print(f"[cyan]{e(module)}[/cyan]: {e(u['reattached'])}")
    for module, fp8 in (report.get("fp8") or {}).items():
        _print_fp8(console, e, module, fp8, show_nodes)
    left = report.get("fp8_fallback")
    if left:
        console.print(f"[yellow]left FP8[/yellow] for bf16 at backward {e(left.get('step'))}: {e(left.get('rule'))} "
                      f"(loss {e(left.get('loss'))}, recent median {e(left.get('median'))})")
    for fb in report.get("fallbacks", []):
        console.print(f"[yellow]FP32 fallback[/yellow] {e(fb['where'])}: {e(fb['reason'])}")
    if show_nodes:
        for g in report["graphs"]:
            nt = Table(title=e(g["name"]))
            for col in ("node", "op", "dtype", "reason"):
                nt.add_column(col)
            for n in g["nodes"]:
                nt.add_row(e(n["name"]), e(n["op"]), e(n["dtype"]), e(n["reason"]))
            console.print(nt)


class NotAReport(ValueError):
    """A file `automp report` cannot show; the message is one line that names the file and what is wrong with it."""


def load_saved_report(path: str) -> dict[str, Any]:
    """The report saved at `path`, checked (check_report). Every way a file can fail to be one (missing, a
    directory, binary, not JSON, JSON of another shape, a malformed section) is a NotAReport naming the file and the
    problem in plain words. A malformed optional section rejects the whole file rather than printing the rest: the
    sections automp writes are always well formed, so one that is not means the file was damaged, edited or written
    by something else, and a partial printout would pass for the whole report."""
    if os.path.isdir(path):
        raise NotAReport(f"{path} is a directory, not a report file")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise NotAReport(f"cannot read {path}: {e.strerror or e}") from None
    if not raw.strip():
        raise NotAReport(f"{path} is empty, not a report")
    try:
        report = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise NotAReport(f"{path} is not JSON (it is not UTF-8 text: a binary file?)") from None
    except json.JSONDecodeError as e:
        raise NotAReport(f"{path} is not JSON (invalid at line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise NotAReport(f"{path} is not an automp precision report: its JSON is nested too deeply") from None
    try:
        check_report(report)
    except ValueError as e:
        raise NotAReport(f"{path} is not an automp precision report: {e}") from None
    return report


def _print_fp8(console: Any, e: Callable[[Any], str], module: str, fp8: dict[str, Any], per_layer: bool) -> None:
    """A root's FP8 choice (automp.runtime.fp8_layers): how many layers each rule decided, the FSDP2 all-gather's
    rules, and with --nodes every layer's choice."""
    from rich.table import Table

    rules = ", ".join(f"{rule} {n}" for rule, n in (fp8.get("rules") or {}).items())
    console.print(f"[cyan]{e(module)}[/cyan] FP8 ({e(fp8.get('recipe'))}): {e(fp8.get('fp8_layers'))} of "
                  f"{e(fp8.get('layers_seen'))} linear layers ({e(rules)})")
    gather = fp8.get("all_gather") or {}
    if gather:
        why = "; ".join(f"{name}: {reason}" for name, reason in (gather.get("why") or {}).items())
        console.print(f"[cyan]{e(module)}[/cyan] FSDP2 all-gather of the FP8 layers: "
                      f"{e(', '.join(f'{r} {n}' for r, n in (gather.get('rules') or {}).items()))}"
                      + (f" ({e(why)})" if why else ""))
    if per_layer and fp8.get("layers"):
        t = Table(title=f"{e(module)}: FP8 per linear layer")
        for col in ("layer", "dtype", "rule", "predicted gain", "error vs bf16", "tokens x in x out"):
            t.add_column(col)
        for name, c in fp8["layers"].items():
            gain, err, shape = c.get("predicted_gain"), c.get("measured_error"), c.get("shape")
            t.add_row(e(name), e(c.get("dtype")), e(c.get("rule")), "-" if gain is None else f"{gain:.2f}x",
                      "-" if err is None else f"{err:.3f}", "-" if not shape else " x ".join(map(str, shape)))
        console.print(t)


def print_saved_report(path: str, show_nodes: bool = False) -> None:
    """Print a report saved as JSON; a file that is not one raises NotAReport (load_saved_report)."""
    print_report(load_saved_report(path), show_nodes=show_nodes)
