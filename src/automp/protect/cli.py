"""`automp protect MODEL.onnx -o OUT.onnx [--seed N] [--ratio R] [--key KEYFILE_or_HEX] [--report R.json]`.

User errors (a corrupt or unsupported model, a wrong key, an output that cannot be written or would overwrite an
input: the model, any external-data file it references, the key file) print one line naming the problem and return 1,
with nothing written; a key that is not 64 hex characters is a usage error (rc 2). Output paths are checked before
any work, and written atomically.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from automp.argtypes import int_at_least, run_main

USER_ERRORS = (ValueError, TypeError, OSError, NotImplementedError, RuntimeError)


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


_seed = int_at_least(0)


def _key(text: str) -> str:
    """argparse type: a key file or hex string that encrypt.read_key accepts (a bad key is a usage error)."""
    from automp.protect.encrypt import read_key
    try:
        read_key(text)
    except (ValueError, OSError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    from automp.protect.obfuscate import ObfuscateConfig

    p = argparse.ArgumentParser(prog="automp protect", description="Obfuscate (and optionally encrypt) an ONNX "
                                "model; it computes the same outputs. Obfuscation-grade, not a security audit.")
    p.add_argument("input", metavar="MODEL.onnx", help="ONNX model to protect")
    p.add_argument("-o", "--output", required=True, metavar="OUT.onnx", help="where to write the protected model")
    p.add_argument("--seed", type=_seed, default=None,
                   help="make the result reproducible (keep it secret: with it the scaling can be undone)")
    p.add_argument("--ratio", type=_ratio, default=ObfuscateConfig.ratio,
                   help="fraction in [0, 1] of eligible spots given identity ops and of nodes wrapped in opaque "
                        f"branches (default {ObfuscateConfig.ratio})")
    p.add_argument("--key", metavar="KEYFILE_or_HEX", type=_key, default=None,
                   help="encrypt the weights with a key of 64 hex characters (32 bytes), given directly or in a file "
                        "(`openssl rand -hex 32 > key.txt`; whitespace around it is ignored); load with "
                        "automp.protect.load(path, key) / automp.protect.session(path, key)")
    p.add_argument("--report", metavar="R.json", default=None, help="write the JSON report here (keep it private)")
    p.add_argument("--rename-io", action="store_true", help="rename graph inputs/outputs too (mapping in the report)")
    p.add_argument("--no-verify", action="store_true", help="skip the onnxruntime check against the input model")
    return p


def check_paths(args: argparse.Namespace) -> dict[str, str]:
    """Before any work: each output can be written, and none is an input (the model, its external-data files, the
    key file) or the other output (onnx_io.check_outputs). Returns the files the input model reads."""
    from automp.deploy import onnx_io
    key_file = args.key if args.key is not None and os.path.isfile(args.key) else None
    return onnx_io.check_outputs({"-o": args.output, "--report": args.report}, args.input, {"the key file": key_file})


def _run(args: argparse.Namespace) -> int:
    from automp.deploy import onnx_io
    from automp.protect.encrypt import read_key
    from automp.protect.obfuscate import ObfuscateConfig, obfuscate

    keep = check_paths(args).values()
    key = read_key(args.key) if args.key is not None else None
    config = ObfuscateConfig(seed=args.seed, ratio=args.ratio, key=key, rename_io=args.rename_io,
                             verify=not args.no_verify)
    model, report = obfuscate(args.input, config)
    onnx_io.save(model, args.output, keep=keep)
    report.output = os.fspath(args.output)
    report.bytes["file"] = os.path.getsize(args.output)
    if args.report:
        report.write(args.report)
    print(f"automp protect: wrote {args.output}")
    for line in report.summary():
        print(f"  {line}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_main("automp protect", build_parser(), _run, USER_ERRORS, argv)


if __name__ == "__main__":
    sys.exit(main())
