"""Text to calibrate AWQ on when the user gives none: docstrings of the Python standard library.

Every Python installation has it, so `automp llm quantize --awq` needs no download; the docstrings are read with
`ast` from the source files, not imported (importing the whole standard library has side effects). The LLM
benchmark trains and evaluates on the same text, split into files for training and held-out files.
"""
from __future__ import annotations

import ast
import os
import random
import sysconfig
import zlib


def stdlib_docstrings(limit: int, heldout_every: int = 10) -> tuple[bytes, bytes]:
    """(train, held-out) docstrings of the standard library's modules, classes and functions, about `limit` bytes of
    training text; a file goes to held-out when crc32 of its path % heldout_every == 0 (no file in both)."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "test", "tests",
                                                              "idle_test", "__pycache__") and not d.startswith("."))
        files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    random.Random(0).shuffle(files)  # a spread of modules, the same on every run
    parts: dict[bool, list[str]] = {False: [], True: []}
    sizes = {False: 0, True: 0}
    budget = {False: limit, True: max(limit // heldout_every, 1)}
    for path in files:
        held = zlib.crc32(os.path.relpath(path, root).encode()) % heldout_every == 0
        if sizes[held] >= budget[held]:
            if sizes[not held] >= budget[not held]:
                break
            continue
        try:
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 40:
                    parts[held].append(doc)
                    sizes[held] += len(doc) + 2
    return "\n\n".join(parts[False]).encode(), "\n\n".join(parts[True]).encode()
