"""Module-level constants of automp.deploy and automp.protect that nothing reads are dead code: a reader takes them
for configuration that matters (scale.ABSORBERS listed the absorbing ops while the code decided elsewhere)."""
import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "automp"


def _constants(path: Path) -> list[str]:
    names = []
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        names += [t.id for t in targets if isinstance(t, ast.Name) and re.fullmatch(r"[A-Z][A-Z0-9_]*", t.id)]
    return names


def test_every_module_constant_is_read_somewhere():
    sources = {p: p.read_text() for p in SRC.rglob("*.py")}
    unused = []
    for folder in ("deploy", "protect"):
        for path in sorted((SRC / folder).rglob("*.py")):
            for name in _constants(path):
                uses = sum(len(re.findall(rf"\b{name}\b", text)) for text in sources.values())
                if uses < 2:  # the definition itself is one
                    unused.append(f"{path.relative_to(SRC)}:{name}")
    assert unused == []
