"""The import graph of src/automp points down: no module imports itself through others, and only automp.bench (and
the command line that runs it) imports automp.bench.

Read from the source with `ast`, every import statement counts, those inside functions too: a function-level import
that closes a circle still makes two modules impossible to understand (or to load) apart. An edge goes to the module
named (`from pkg import sub` -> pkg.sub when sub is a module, else pkg); the implicit import of a parent package is
not an edge, or every package that re-exports its submodules would be a circle.
"""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

# The command line runs the benchmark suites (`automp bench`, `automp llm bench`): it sits above bench.
BENCH_RUNNERS = {"automp.cli"}
# Known offenders: none. A circle added later is named here only with its reason, or broken.
KNOWN_CYCLES: set[frozenset[str]] = set()
KNOWN_BENCH_IMPORTERS: set[str] = set()


def modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "automp").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is an automp module (None outside automp)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def imports_of(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [_resolve(a.name, known) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else _resolve(base, known)
                       for a in node.names]
        else:
            continue
        found.update(t for t in targets if t is not None and t != module)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports_of(m, p, known) for m, p in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(frozenset(component))
    return out


def test_the_checker_finds_a_circle_inside_functions(tmp_path):
    pkg = tmp_path / "automp"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from automp import b\n")
    (pkg / "b.py").write_text("def f():\n    from automp.a import x\n")
    known = {"automp": pkg / "__init__.py", "automp.a": pkg / "a.py", "automp.b": pkg / "b.py"}
    edges = {m: imports_of(m, p, known) for m, p in known.items()}
    assert edges["automp.b"] == {"automp.a"} and edges["automp.a"] == {"automp.b"}
    assert cycles(edges) == [frozenset({"automp.a", "automp.b"})]


def test_no_import_cycles():
    found = set(cycles(graph()))
    assert found - KNOWN_CYCLES == set(), sorted(sorted(c) for c in found - KNOWN_CYCLES)


def test_only_bench_imports_bench():
    offenders = {m for m, targets in graph().items()
                 if not (m == "automp.bench" or m.startswith("automp.bench.")) and m not in BENCH_RUNNERS
                 and any(t == "automp.bench" or t.startswith("automp.bench.") for t in targets)}
    assert offenders - KNOWN_BENCH_IMPORTERS == set(), sorted(offenders - KNOWN_BENCH_IMPORTERS)
