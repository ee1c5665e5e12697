"""The command line a new user meets: every argument explains itself in --help, `--version` answers, and a mistyped
option is reported by the sub-command it was given to."""
import argparse
import subprocess
import sys

import pytest

import automp
from automp.cli import build_parser, main


def _actions(parser: argparse.ArgumentParser, where: str = "automp"):
    """(where, action) for every action of parser and, recursively, of its sub-commands' parsers."""
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        yield where, action
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _actions(sub, f"{where} {name}")


def test_every_argument_has_help():
    missing = [f"{where}: {a.option_strings or a.dest}" for where, a in _actions(build_parser())
               if not (a.help and a.help.strip()) or a.help == argparse.SUPPRESS]
    assert missing == []
    walked = {where for where, _ in _actions(build_parser())}
    assert {"automp run", "automp demo", "automp report", "automp bench"} <= walked


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"automp {automp.__version__}"


def test_version_from_the_command_line():
    res = subprocess.run([sys.executable, "-m", "automp", "--version"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == f"automp {automp.__version__}"


@pytest.mark.parametrize("argv, command", [
    (["run", "--bogus", "train.py"], "run"),
    (["demo", "--bogus"], "demo"),
    (["report", "--bogus", "r.json"], "report"),
    (["bench", "--bogus", "kernels"], "bench"),
])
def test_an_unknown_option_is_reported_by_its_sub_command(capsys, argv, command):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: automp {command}")
    assert err.strip().splitlines()[-1] == f"automp {command}: error: unrecognized arguments: --bogus"


@pytest.mark.parametrize("argv, missing", [(["run"], "script"), (["run", "--bogus"], "script"),
                                           (["bench"], "suite")])
def test_a_missing_positional_names_only_what_is_missing(capsys, argv, missing):
    """The script's own arguments (and a suite's) may be empty: the error names only what the user must give."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"automp {argv[0]}: error: the following arguments are required: {missing}"
