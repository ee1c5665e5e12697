"""Functions with a code object of their own, for torch.compile.

Dynamo keeps a frame's compiled graphs, and counts its recompiles against a limit (8 by default), per code object. A
function compiled for many objects (every model a session runs, every decoder of a process) would share one code
object: each object's graphs would evict the others', and past the limit the frame would run uncompiled, silently.
This module imports nothing else of automp, so every layer may use it.
"""
from __future__ import annotations

import types
from typing import Any, Callable


def own_code(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """`fn` with a code object of its own, named `name` (what Dynamo's logs and recompile messages show)."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
