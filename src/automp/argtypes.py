"""Command-line plumbing the CLIs share (automp, automp llm, automp protect, automp optimize).

A bad value is a one-line usage error (rc 2) from argparse itself, never a traceback from deep inside the command;
a user error inside the command is one line on stderr and rc 1.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence


def int_at_least(minimum: int) -> Callable[[str], int]:
    """argparse type: a whole number >= `minimum`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    return parse


def run_main(prog: str, parser: argparse.ArgumentParser, run: Callable[[argparse.Namespace], int],
             user_errors: tuple[type[BaseException], ...], argv: Sequence[str] | None) -> int:
    """Parse, run, and turn the errors a user can cause into `prog: error: Type: message` and rc 1."""
    args = parser.parse_args(argv)
    try:
        return run(args)
    except user_errors as e:
        print(f"{prog}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
