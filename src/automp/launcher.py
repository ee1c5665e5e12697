"""`automp run SCRIPT ARGS`: run a script exactly as `python SCRIPT ARGS` would, with automp enabled.

Same sys.argv, `__main__`, sys.path[0] and exit code; an exception in the script prints the script's own traceback
(our frames removed) and exits 1, as Python would. The report is written however the script ends.
"""
from __future__ import annotations

import os
import runpy
import sys
import traceback
from typing import Any, Sequence

import automp
from automp.files import check_writable, same_file


def run_script(script: str, args: Sequence[str], dtype: str = "auto", loss_scale: Any = "dynamic",
               report: str | None = None, inner: str | None = None, path: str | None = None,
               fuse_optimizers: bool = True, tune_cudnn: bool = True, tune_layout: bool = True,
               cuda_graphs: bool = True) -> int:
    if not os.path.isfile(script):
        print(f"automp run: cannot open file {script!r}: no such file", file=sys.stderr)
        return 2
    problem = _report_problem(report, script)
    if problem:
        print(f"automp run: {problem}", file=sys.stderr)
        return 2
    try:
        automp.enable(dtype=dtype, loss_scale=_parse_loss_scale(loss_scale), report=report,
                      inner=inner or os.environ.get("AUTOMP_INNER", "inductor"),
                      path=path if path not in (None, "auto") else os.environ.get("AUTOMP_PATH", "auto"),
                      fuse_optimizers=fuse_optimizers, tune_cudnn=tune_cudnn,
                      tune_layout=tune_layout, cuda_graphs=cuda_graphs)
    except (ValueError, TypeError) as e:
        print(f"automp run: {e}", file=sys.stderr)
        return 2
    argv, path0 = sys.argv[:], sys.path[0] if sys.path else None
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException as e:  # noqa: BLE001 - mirror Python's own top-level handler
        tb = e.__traceback__
        while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != os.path.abspath(script):
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb or e.__traceback__)
        hint = automp.script_failed(e)
        if hint:
            print(hint, file=sys.stderr)
        code = 130 if isinstance(e, KeyboardInterrupt) else 1
    finally:
        rep = automp.disable()
        sys.argv = argv
        if path0 is not None and sys.path and sys.path[0] != path0:
            sys.path.pop(0)
    if rep is not None and report:
        print(f"automp: precision report written to {report} (view it with `automp report {report}`)",
              file=sys.stderr)
    return code


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


def _parse_loss_scale(spec: Any) -> Any:
    if isinstance(spec, str) and spec not in ("dynamic", "off"):
        try:
            return float(spec)
        except ValueError:
            raise SystemExit(f"automp run: --loss-scale must be 'dynamic', 'off' or a number, not {spec!r}") from None
    return spec
