"""The layout checks of docs/design.md, made by a script rather than by review: the package's folders import downward
only, FP8 lives in one package, no module grows past what one reader holds, one-off scripts stay out of the tree,
docstrings explain rather than quote a day's timings, and the environment is read in one place."""
from __future__ import annotations

import re
from pathlib import Path

from tests.test_imports import cycles, graph

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "automp"

MAX_LINES = 450
MAX_SCRIPTS = 5
MAX_TIMING_LINES = 5
# A line that quotes a device, or a measured time, memory, rate or ratio: the figures that go stale in a docstring.
TIMING = re.compile(r"H100|H200|A100|\b\d+(\.\d+)?\s?(ms|us|µs|GiB|MiB|TFLOP/s|GB/s)\b|\b\d+\.\d+x\b")
ENV_READ = re.compile(r"""(environ(\.get)?\s*[\[(]|getenv\()\s*f?["']AUTOMP_""")


def _unit(module: str) -> str:
    """The folder (or top-level module) a module belongs to: automp.runtime.guards.rnn -> runtime."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "automp"


def package_graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for module, targets in graph().items():
        edges.setdefault(_unit(module), set()).update(_unit(t) for t in targets if _unit(t) != _unit(module))
    return edges


def test_folders_import_downward_only():
    """No two folders import each other, even through others: an order from the command line down to the kernels
    exists. `automp` (the package's front door, enable/disable) sits above the runtime it installs."""
    edges = package_graph()
    assert cycles(edges) == [], cycles(edges)
    assert "runtime" not in edges.get("config", set()) and "bench" not in edges.get("runtime", set())


def test_fp8_lives_in_one_package():
    fp8 = PACKAGE / "precision" / "fp8"
    assert (fp8 / "__init__.py").is_file()
    outside = [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*fp8*.py") if fp8 not in p.parents]
    # the runtime's one adapter, and benchmark suites named for what they measure
    assert sorted(p for p in outside if p != "runtime/fp8_layers.py" and not p.startswith("bench/")) == []


def test_no_module_is_longer_than_one_reader_holds():
    long = {p.relative_to(PACKAGE).as_posix(): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_one_off_scripts_stay_out_of_the_tree():
    scripts = ROOT / "scripts"
    found = sorted(p.name for p in scripts.iterdir()) if scripts.is_dir() else []
    assert len(found) <= MAX_SCRIPTS, found


def test_docstrings_explain_rather_than_quote_timings():
    lines = [f"{p.relative_to(PACKAGE).as_posix()}:{i}: {line.strip()}" for p in sorted(PACKAGE.rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if TIMING.search(line)]
    assert len(lines) <= MAX_TIMING_LINES, "\n".join(lines)


def test_the_timing_check_sees_a_quoted_timing():
    assert TIMING.search("# on an H100 the step took 20.4 ms") and TIMING.search("ran 1.07x the anchor")
    assert not TIMING.search("MIN_GAIN = 1.10  # predicted speedup before a layer is offered FP8")


def test_only_config_reads_automp_environment_variables():
    readers = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
                     if ENV_READ.search(p.read_text()))
    assert readers == ["config.py"], readers


def test_the_environment_check_sees_a_read():
    assert ENV_READ.search('os.environ.get("AUTOMP_DIST_TIMEOUT", 900)')
    assert ENV_READ.search("os.environ['AUTOMP_PATH']") and ENV_READ.search('os.getenv("AUTOMP_X")')
    assert not ENV_READ.search('help="as $AUTOMP_FP8_KEEP does"')
