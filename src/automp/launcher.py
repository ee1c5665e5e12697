"""`automp run SCRIPT ARGS`: run a script exactly as `python SCRIPT ARGS` would, with automp enabled.

Same sys.argv, `__main__`, sys.path[0] and exit code; a script that does not compile shows Python's own message,
an exception in the script prints the script's own traceback (our frames removed) and exits 1, as Python would.
The report is written however the script ends (SIGTERM included, then exit 143 as a shell reports for a
SIGTERM'd python), and one line on stderr says how each model ran.
"""
from __future__ import annotations

import dataclasses
import os
import runpy
import signal
import sys
import traceback
import zipfile
from typing import Any, Sequence

import automp
from automp.config import AutoMPConfig
from automp.files import check_writable, same_file
from automp.precision.causal_mask import CAUSAL_ATTENTION
from automp.precision.linear_ce import FUSED_LINEAR_CE
from automp.precision.siblings import FUSED_SIBLINGS
from automp.runtime.report import notice
from automp.runtime.decisions import (COMPILE_FAILED, COMPILED_PATHS, FORCED, FUNCTORCH, HALF_MODEL,
                                      SCRIPTS_AUTOCAST)

SIGTERM_EXIT = 128 + signal.SIGTERM  # 143
_SHORT = {"bfloat16": "bf16", "float16": "fp16"}
_ASIDE = {SCRIPTS_AUTOCAST: "the script's own autocast", HALF_MODEL: "already half precision",
          COMPILE_FAILED: "compilation failed"}  # by rule
_COMPILED = {r.value for r in COMPILED_PATHS}
_REWRITES = {CAUSAL_ATTENTION: "causal mask(s) as is_causal", FUSED_SIBLINGS: "sibling linear group(s) as one GEMM",
             FUSED_LINEAR_CE: "output layer(s) + cross-entropy in blocks"}  # by rule
_IN_TRANSFORM = "calls ran inside a torch.func transform, which torch.compile cannot trace from eager code"


# What the script left in its globals, kept until the interpreter exits, as `python SCRIPT` keeps them. runpy returns
# a copy and frees the script's own module; dropping the copy too would free the script's objects inside this call,
# and a torch.distributed job's DDP module freed there (its process group already destroyed) waited for ever in the
# gloo process group's destructor.
_SCRIPT_GLOBALS: list[dict[str, Any]] = []


def run_script(script: str, args: Sequence[str], config: AutoMPConfig | None = None) -> int:
    """Run `script` with `args` under automp configured by `config` (default: the environment's); the exit code."""
    config = config or AutoMPConfig.from_env()
    problem = _script_problem(script, args) or _report_problem(config.report_path, script)
    if problem:
        print(f"automp run: {problem}", file=sys.stderr)
        return 2
    unreadable = _compile_error(script)
    if unreadable is not None:
        return unreadable
    from automp.runtime.fp8_layers import Fp8Unavailable
    from automp.runtime.guards.rank_watch import RankWatch
    # the session writes no report of its own: the launcher writes the command line's once, at the end
    try:
        automp.enable(dataclasses.replace(config, report=None))
    except Fp8Unavailable as e:  # asked for on a machine without FP8: nothing was installed, the script not run
        print(f"automp run: {e}", file=sys.stderr)
        return 2
    recorder = automp.recorder()
    argv, path0 = sys.argv[:], sys.path[0] if sys.path else None
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    previous = _exit_on_sigterm()
    watch = RankWatch(config.rank).start() if config.world_size > 1 else None
    code = 0
    try:
        _SCRIPT_GLOBALS.append(runpy.run_path(script, run_name="__main__"))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        if code and watch is not None:
            watch.failed(f"the script exited with code {code}")
    except BaseException as e:  # noqa: BLE001 - mirror Python's own top-level handler
        tb = e.__traceback__
        while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != os.path.abspath(script):
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb or e.__traceback__)
        if watch is not None:
            watch.failed(f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
        hint = automp.script_failed(e)
        if hint:
            notice(hint)
        code = 130 if isinstance(e, KeyboardInterrupt) else 1
    finally:
        if watch is not None:
            watch.stop()
        automp.disable()  # writes the report the script asked for itself, if it did (enable(report=...))
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        sys.argv = argv
        if path0 is not None and sys.path and sys.path[0] != path0:
            sys.path.pop(0)
    # the command line's --report, whatever the script did with automp (its own enable(report=...), disable())
    if config.report_path:
        recorder.save(config.report_path)
    print(summary(recorder.as_dict(), config), file=sys.stderr)
    return code


def summary(report: dict[str, Any], config: AutoMPConfig) -> str:
    """One line: how each root module ran, from the report's paths, rules and call counts (never its reason
    strings): what really ran, the trial's calls included, not only the path a verdict named."""
    from automp.precision.fp8.gather import FP8_GATHER
    from automp.runtime.report import calls_in_words
    low = _SHORT.get(report.get("dtype", ""), report.get("dtype", ""))
    parts = []
    for choice in report.get("choices", []):
        path, module = choice["path"], choice["module"]
        trial = calls_in_words((choice.get("calls") or {}).get("trial"), low)
        no_graph = _no_graph(report, choice)
        if path == "as-written":
            parts.append(f"{module} as written ({_ASIDE.get(choice.get('rule'), 'left to the script')})")
        elif path == "unsettled":
            parts.append(f"{module} trial unfinished" + (f" (trial: {trial})" if trial else ""))
        elif no_graph:
            parts.append(_without_graphs(report, choice, low))
        elif path == "fp32-eager":
            parts.append(f"{module} fp32-eager" + (f": kept FP32 as written (trial: {trial})" if trial else ""))
        else:
            fp8 = report.get("fp8", {}).get(module) if path.startswith("fp8-") else None
            layers = f", {fp8['fp8_layers']} of {fp8['layers_seen']} linear layers FP8" if fp8 else ""
            gathered = (fp8 or {}).get("all_gather", {}).get("rules", {}).get(FP8_GATHER)
            layers += f", {gathered} all-gathered in FP8" if gathered else ""
            layers += f"; trial: {trial}" if trial else ""
            parts.append(f"{module} {path} ({low}{layers})")
        rules = [r["rule"] for r in report.get("rewrites", []) if r["module"] == module]
        if path in _COMPILED and rules:
            parts[-1] += "; " + ", ".join(f"{rules.count(rule)} {words}" for rule, words in _REWRITES.items()
                                          if rule in rules)
        also = {p: n for p, n in ((choice.get("calls") or {}).get("chosen") or {}).items() if p != path}
        if also and not no_graph:  # moved off its verdict's path, or some calls could not take it
            parts[-1] += "; also ran " + ", ".join(f"{n} call(s) {p}" for p, n in also.items()) + (
                f" ({_IN_TRANSFORM})" if _fell_back(report, module, FUNCTORCH) else "")
    line = "; ".join(parts) or "no module ran under automp (none was called as model(x) while it was on)"
    left = report.get("fp8_fallback")
    if left:
        line += f"; left FP8 for bf16 at backward {left['step']} ({left['rule']})"
    if config.report_path:
        line += f"; report in {config.report_path} (`automp report {config.report_path}`)"
    who = "automp" if config.world_size == 1 else f"automp (rank {config.rank})"
    return f"{who}: {line}"


def _fell_back(report: dict[str, Any], module: str, rule: str) -> bool:
    return any(f.get("where") == module and f.get("rule") == rule for f in report.get("fallbacks", []))


def _no_graph(report: dict[str, Any], choice: dict[str, Any]) -> bool:
    """A compiled path that ran no graph: none of the module's calls took it (a torch.func transform, where
    torch.compile cannot trace), or automp's own pass saw no graph of it. Only where the report counted calls."""
    path, chosen = choice["path"], (choice.get("calls") or {}).get("chosen") or {}
    if path not in _COMPILED or not chosen:
        return False
    if not chosen.get(path):
        return True
    return path == "automp-compiled" and not any(g.get("name", "").split(".")[0] == choice["module"]
                                                 for g in report.get("graphs", []))


def _without_graphs(report: dict[str, Any], choice: dict[str, Any], low: str) -> str:
    """What ran in place of a compiled path that ran no graph, and why."""
    module, path = choice["module"], choice["path"]
    chosen = (choice.get("calls") or {}).get("chosen") or {}
    ran = max(chosen, key=chosen.get)
    ran = "fp32-eager" if ran == path == "automp-compiled" else ran
    what = ("FP32 as written" if ran == "fp32-eager" else f"{low} eager under torch.autocast" if ran != path
            else f"{path} eagerly")
    mine = [f for f in report.get("fallbacks", []) if f.get("where") == module]
    if _fell_back(report, module, FUNCTORCH):
        why = f"its {_IN_TRANSFORM}"
    elif mine:
        why = f"its graphs fell back: {mine[0]['reason']}"
    else:
        why = "Dynamo compiled no graph for it"
    how = "forced" if choice.get("rule") == FORCED else "chosen"
    return f"{module} {path} {how}, but no graph ran through it: the model ran {what} ({why})"


def _script_problem(script: str, args: Sequence[str]) -> str | None:
    """A script automp cannot run as asked: a launcher that would start its workers without automp, or no file."""
    if _is_torchrun(script):
        at = next((i for i, a in enumerate(args) if a.endswith(".py")), len(args))
        inside = " ".join(["torchrun", *args[:at], "-m", "automp", "run", *args[at:]])
        return (f"{os.path.basename(script)} would start its workers without automp; run automp inside each "
                f"worker instead: `{inside}`")
    if os.path.isdir(script):
        return f"cannot run {script!r}: it is a directory, not a script"
    if not os.path.isfile(script):
        return f"cannot open file {script!r}: no such file"
    return None


def _is_torchrun(script: str) -> bool:
    """torchrun itself: by name, or a console-script wrapper by what it imports."""
    if os.path.splitext(os.path.basename(script))[0] == "torchrun":
        return True
    try:
        with open(script, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return b"torch.distributed.run" in head or b"torch.distributed.launch" in head


def _compile_error(script: str) -> int | None:
    """What `python SCRIPT` shows for a script that does not compile, and its exit code (1); None if it compiles.
    Checked before automp is enabled: a SyntaxError shows the script's file and line, not our frames."""
    if zipfile.is_zipfile(script):
        return None  # a zipped application: runpy finds its __main__
    try:
        with open(script, "rb") as f:
            compile(f.read(), script, "exec", dont_inherit=True)
    except SyntaxError as e:
        if e.filename == script and "null bytes" not in e.msg and "unicode error" not in e.msg:
            traceback.print_exception(type(e), e, None)  # the script's file, line and caret, as Python shows them
            return 1
        error = e.msg
    except ValueError as e:  # null bytes, before Python 3.12
        error = str(e)
    else:
        return None
    print(f"automp run: cannot run {script!r}: not a Python script (a binary file? {error})", file=sys.stderr)
    return 1


def _exit_on_sigterm() -> Any:
    """SIGTERM (a scheduler's timeout, `kill`) ends the script through SystemExit, so the report is still written;
    the previous handler comes back after the run. None where no handler can be set (not the main thread)."""
    def terminate(signum: int, frame: Any) -> None:
        raise SystemExit(SIGTERM_EXIT)
    try:
        return signal.signal(signal.SIGTERM, terminate) or signal.SIG_DFL
    except ValueError:
        return None


def _report_problem(report: str | None, script: str) -> str | None:
    """Where the report goes is checked before the script runs: a report that cannot be written must not cost a
    finished training run its exit code, and a report path that names the script must not overwrite it."""
    if not report:
        return None
    if same_file(report, script):
        return f"--report {report!r} is the script itself: refusing to overwrite it"
    try:
        check_writable(report, "--report")
    except OSError as e:
        return str(e)
    return None
