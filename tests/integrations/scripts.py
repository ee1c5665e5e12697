"""What the integration tests share: a training script written to a temporary folder and imported from it, and
that script run in a subprocess (as `automp run`, `accelerate launch`, or plain python) with its losses read back."""
import importlib
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AUTOMP_RUN = ["-m", "automp", "run", "--dtype", "bf16", "--path", "eager"]  # forced: the CPU trial picks by timing


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}


def write_and_import(tmp_path, name: str, source: str):
    """(path, module) of `source` saved as tmp_path/name.py and imported."""
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    sys.path.insert(0, str(tmp_path))
    try:
        return path, importlib.import_module(name)
    finally:
        sys.path.pop(0)


def run(command: list[str], cwd) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, env=env(), timeout=600, cwd=cwd)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def losses(command: list[str], cwd) -> list[float]:
    """The list a script prints as `LOSSES [...]`."""
    out = run(command, cwd).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("LOSSES "))[7:])


def close(got: list[float], want: list[float], n: int) -> bool:
    """The same number of steps and the same losses: the same ops in the same order, to float rounding."""
    return len(got) == len(want) == n and max(abs(a - b) / abs(b) for a, b in zip(got, want)) < 1e-3
