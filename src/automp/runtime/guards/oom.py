"""Out-of-memory errors a trial can survive: what they asked for, and the one inside a compile failure.

Why: a trial runs candidates the script as written never runs (compiled graphs, CUDA graph pools beside the eager
paths' cached blocks), so a script that fits can meet an out-of-memory error in one of them. The trial takes that
candidate out and runs the call again on the next one (automp.runtime.paths.RootPaths.out_of_memory); these helpers
read the error for it and for the report."""
from __future__ import annotations

import re

import torch


def oom_size(error: BaseException) -> str | None:
    """How much more memory the failed allocation asked for ("2.00 GiB"), where the error says."""
    found = re.search(r"[Tt]ried to allocate ([\d.]+ ?[KMGT]i?B)", str(error))
    return found.group(1) if found else None


def oom_cause(error: BaseException) -> BaseException | None:
    """The out-of-memory error inside a compile failure (Inductor's autotuning, a graph's first run), if that is what
    it was: Dynamo wraps it (BackendCompilerFailed.inner_exception, or as the cause)."""
    seen: BaseException | None = error
    for _ in range(8):  # a chain of causes, never a cycle
        if seen is None or isinstance(seen, torch.OutOfMemoryError):
            return seen
        seen = getattr(seen, "inner_exception", None) or seen.__cause__
    return None
