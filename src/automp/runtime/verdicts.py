"""Trial verdicts on disk: the next run of the same script starts on the winner and pays nothing.

The key is what decides a trial's outcome (module structure and shapes, dtype, device, versions), never parameter
values: a script run again, or a checkpoint reloaded, finds its verdict.
"""
from __future__ import annotations

import enum
import hashlib
import json
import os
import time
from pathlib import Path as FsPath
from typing import Any, Iterable, Mapping

from automp.runtime.trial import Path, Verdict
from automp.files import atomic_output


class VerdictCache:
    """Verdicts on disk, keyed by what decides the outcome: the module's structure and shapes, dtype, device and
    the torch/automp versions. A corrupt file is ignored (and replaced at the next write), never fatal."""

    def __init__(self, directory: str | os.PathLike | None = None):
        root = directory or os.environ.get("AUTOMP_CACHE_DIR") or FsPath.home() / ".cache" / "automp"
        self.path = FsPath(root) / "verdicts.json"

    def _load(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: str, kind: type[enum.Enum] = Path) -> Verdict | None:
        """kind: what the entry's "path" names (a Path; automp.runtime.tuning.conv_tuning caches a Flag the same way)."""
        entry = self._load().get(key)
        try:
            return Verdict(kind(entry["path"]), entry["reason"], dict(entry["timings_ms"]), cached=True,
                           detach=tuple(str(n) for n in entry.get("detach", ())),
                           confirmed=bool(entry.get("confirmed", False)), eager_only=bool(entry.get("eager_only")))
        except (TypeError, KeyError, ValueError):
            return None

    def put(self, verdicts: Mapping[str, Verdict]) -> None:
        """One read and one write for all the modules a trial settles (key -> its verdict)."""
        data = self._load()
        when = time.strftime("%Y-%m-%dT%H:%M:%S")
        data.update({key: {**v.as_dict(), "detach": list(v.detach), "eager_only": v.eager_only, "when": when}
                     for key, v in verdicts.items()})
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_output(self.path) as tmp, open(tmp, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1)
        except OSError:
            pass  # an unwritable cache costs a new trial next run, nothing else


def module_key(module: Any, args: Iterable[Any], dtype: str, device: str, extra: str = "") -> str:
    """What makes two runs the same for the verdict: module classes and parameter shapes (not values), the shapes
    and dtypes of the first call's tensor arguments, dtype, device and versions."""
    import torch

    import automp

    parts = [type(module).__qualname__, dtype, device, torch.__version__, automp.__version__, extra]
    parts += [f"{n}:{_shape(p)}:{p.dtype}" for n, p in module.named_parameters()]
    parts += [f"{tuple(a.shape)}:{a.dtype}" for a in args if isinstance(a, torch.Tensor)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


def _shape(p: Any) -> str:
    """A parameter's shape; a lazy module's (nn.LazyLinear) before its first call has none yet."""
    from torch.nn.parameter import is_lazy

    return "uninitialized" if is_lazy(p) else str(tuple(p.shape))
