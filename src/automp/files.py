"""Output files: checked before any work, written so that a failed write leaves what was there before.

`automp optimize` may take minutes before it writes anything, so a path it cannot write (a missing or read-only
directory) is reported first, not after the work. And a write that fails halfway (disk full, a serializer error)
must not leave a truncated file in place of the previous one: every writer writes into a temporary directory beside
the destination (same filesystem, so the final move is an atomic rename) and only a complete write is moved over.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator

PathLike = str | os.PathLike


def same_file(a: PathLike, b: PathLike) -> bool:
    """Whether a and b name one file: by inode where both exist (hard links, bind mounts, symlinks), else by the
    resolved path (an output that does not exist yet can still be spelled differently from its input)."""
    if os.path.exists(a) and os.path.exists(b):
        return os.path.samefile(a, b)
    return os.path.realpath(a) == os.path.realpath(b)


def check_writable(path: PathLike, what: str) -> None:
    """Raise an OSError naming `what` unless `path` can be written: not a directory nor a write-protected file (the
    atomic rename would replace one regardless), and its directory exists and takes new files (probed by creating
    one, which also catches read-only filesystems and root-squashed mounts)."""
    real = os.path.realpath(path)
    folder = os.path.dirname(real)
    if os.path.isdir(real):
        raise IsADirectoryError(f"{what} {os.fspath(path)} is a directory")
    if os.path.exists(real) and not os.access(real, os.W_OK):
        raise PermissionError(f"{what} {os.fspath(path)} is write-protected")
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{what} {os.fspath(path)}: directory {folder} does not exist")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise PermissionError(f"{what} {os.fspath(path)}: cannot write in {folder} ({e.strerror})") from None


def fsync_path(path: str) -> None:
    """Flush a written file or a directory to disk: a full disk may only report itself here (delayed allocation)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_output(path: PathLike) -> Iterator[str]:
    """Yield where to write `path`: a file of the same name in a fresh temporary directory beside it, so side files
    named after it (ONNX external data) can be written there too. On a clean exit every file written there is moved
    into place, `path` itself last; on an exception nothing is moved and the temporary directory is removed.

    A symlink at `path` is written through, as open(path, "w") would, and an existing file keeps its permissions.
    """
    real = os.path.realpath(path)
    folder, name = os.path.split(real)
    tmp = tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    try:
        yield os.path.join(tmp, name)
        written = sorted(os.listdir(tmp), key=lambda f: f == name)
        for f in written:
            fsync_path(os.path.join(tmp, f))
        for f in written:
            dest = os.path.join(folder, f)
            if os.path.exists(dest):
                shutil.copymode(dest, os.path.join(tmp, f))
            os.replace(os.path.join(tmp, f), dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_json_and_markdown(out_dir: PathLike, stem: str, payload: object, md: str) -> tuple[str, str]:
    """`<stem>.json` and `<stem>.md` in `out_dir`, each written atomically (a benchmark's results survive a run that
    dies while writing); returns their paths."""
    import json
    os.makedirs(out_dir, exist_ok=True)
    paths = os.path.join(out_dir, f"{stem}.json"), os.path.join(out_dir, f"{stem}.md")
    for path, text in zip(paths, (json.dumps(payload, indent=2), md)):
        with atomic_output(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
    return paths


def check_outputs(outputs: dict[str, PathLike | None], inputs: dict[str, PathLike | None]) -> None:
    """Before any work: every output (flag -> path) can be written, none is an input (description -> path), and no
    two outputs are the same file. A ValueError names the flag and the file."""
    given = [(flag, path) for flag, path in outputs.items() if path is not None]
    for flag, path in given:
        for what, src in inputs.items():
            if src is not None and same_file(path, src):
                raise ValueError(f"{flag} {path} is {what}; refusing to overwrite it (write elsewhere)")
        check_writable(path, flag)
    for i, (flag_a, a) in enumerate(given):
        for flag_b, b in given[i + 1:]:
            if same_file(a, b):
                raise ValueError(f"{flag_a} and {flag_b} name the same file {a}")
