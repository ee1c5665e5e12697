"""Trial verdicts on disk: the next run of the same script starts on the winner and pays nothing.

The key is what decides a trial's outcome (module structure, code and shapes, dtype, device, versions), never
parameter values: a script run again, or a checkpoint reloaded, finds its verdict; another model that happens to
share a class name and shapes does not.

Under torch.distributed only rank 0 writes: the ranks of a job run rank 0's verdicts (automp.runtime.ranks.agreed), and
one writer per job keeps N ranks from queueing on the lock with the same verdicts. Several processes may still write at
once (two scripts on one machine): each write reads, updates and replaces the file under an exclusive lock on a
sibling lock file, so none drops another's verdicts. Where fcntl is
missing (Windows) there is no lock: every write is still atomic, so the file is never torn, but concurrent writers
may each keep only their own new verdicts.
"""
from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import os
import sys
import time
import weakref
from pathlib import Path as FsPath
from types import CodeType
from typing import Any, Iterable, Iterator, Mapping

from automp.files import atomic_output
from automp.runtime.ranks import writer
from automp.runtime.decisions import CACHED_LEGACY, Route, Verdict

try:
    import fcntl
except ImportError:  # not POSIX: writes stay atomic, but unlocked (see the module's docstring)
    fcntl = None


class VerdictCache:
    """Verdicts on disk under `directory`, keyed by module_key. A corrupt file is ignored (and replaced at the next
    write), never fatal. `directory` is the caller's (AutoMPConfig.cache_dir resolves the default, so that every
    cache agrees on it)."""

    def __init__(self, directory: str | os.PathLike):
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"the verdict cache needs a directory path (AutoMPConfig.cache_dir), got {directory!r}")
        self.path = FsPath(directory) / "verdicts.json"

    def _load(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: str, kind: type[enum.Enum] = Route) -> Verdict | None:
        """kind: what the entry's "path" names (a Route; automp.runtime.tuning.conv_tuning caches a Flag the same
        way)."""
        entry = self._load().get(key)
        try:
            return Verdict(kind(entry["path"]), entry["reason"], dict(entry["timings_ms"]), cached=True,
                           rule=str(entry.get("rule", CACHED_LEGACY)),
                           detach=tuple(str(n) for n in entry.get("detach", ())),
                           confirmed=bool(entry.get("confirmed", False)), eager_only=bool(entry.get("eager_only")))
        except (TypeError, KeyError, ValueError):
            return None

    def put(self, verdicts: Mapping[str, Verdict]) -> None:
        """One locked read-modify-write for all the modules a trial settles (key -> its verdict); rank 0's alone under
        torch.distributed."""
        if not writer():
            return
        when = time.strftime("%Y-%m-%dT%H:%M:%S")
        new = {key: {**v.as_dict(), "detach": list(v.detach), "eager_only": v.eager_only, "when": when}
               for key, v in verdicts.items()}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._locked():
                data = self._load()
                data.update(new)
                with atomic_output(self.path) as tmp, open(tmp, "w", encoding="utf-8") as f:
                    json.dump(data, f, indent=1)
        except OSError:
            pass  # an unwritable cache costs a new trial next run, nothing else

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold an exclusive lock on `verdicts.json.lock` (not on the data file: os.replace swaps that file, and a
        lock on the replaced one would guard nothing)."""
        if fcntl is None:
            yield
            return
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def module_key(module: Any, args: Iterable[Any], dtype: str, device: str, extra: str = "") -> str:
    """What makes two runs the same for the verdict: module classes, the code of their forwards and parameter
    shapes (not values), the shapes and dtypes of the first call's tensor arguments, dtype, device and versions."""
    import torch

    from automp.config import VERSION

    parts = [type(module).__qualname__, dtype, device, torch.__version__, VERSION, extra,
             sys.implementation.cache_tag or ""]  # the bytecode digests below are per Python version
    parts += sorted({_code_digest(type(m)) for m in module.modules()})
    parts += [f"{n}:{_shape(p)}:{p.dtype}" for n, p in module.named_parameters()]
    parts += [f"{tuple(a.shape)}:{a.dtype}" for a in args if isinstance(a, torch.Tensor)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


_digests: weakref.WeakKeyDictionary[type, tuple[Any, str]] = weakref.WeakKeyDictionary()


def _code_digest(cls: type) -> str:
    """A digest of `cls.forward`'s bytecode, computed once per class (and again if forward is replaced). Bytecode,
    not source: it exists for classes made at run time too, and ignores where in its file the code sits."""
    forward = getattr(cls, "forward", None)
    known = _digests.get(cls)
    if known is not None and known[0] is forward:
        return known[1]
    code = getattr(getattr(forward, "__func__", forward), "__code__", None)
    if isinstance(code, CodeType):
        text = _code_text(code)
    else:  # not Python code (a scripted or C method): its name is all there is to go by
        text = getattr(forward, "__qualname__", type(forward).__qualname__)
    digest = f"{cls.__qualname__}={hashlib.sha256(text.encode()).hexdigest()[:16]}"
    _digests[cls] = (forward, digest)
    return digest


def _code_text(code: CodeType) -> str:
    """The parts of a code object that say what it computes, in a form stable across processes: nested code
    (comprehensions, lambdas) recursively, and set constants sorted (their order follows string hashing, which
    changes from one process to the next)."""
    return "\n".join([code.co_code.hex(), ",".join(code.co_names), ",".join(code.co_varnames),
                      *(_const_text(c) for c in code.co_consts)])


def _const_text(c: Any) -> str:
    if isinstance(c, CodeType):
        return "<" + _code_text(c) + ">"
    if isinstance(c, frozenset):
        return "{" + ",".join(sorted(_const_text(x) for x in c)) + "}"
    if isinstance(c, tuple):
        return "(" + ",".join(_const_text(x) for x in c) + ")"
    return repr(c)


def _shape(p: Any) -> str:
    """A parameter's shape; a lazy module's (nn.LazyLinear) before its first call has none yet."""
    from torch.nn.parameter import is_lazy

    return "uninitialized" if is_lazy(p) else str(tuple(p.shape))
