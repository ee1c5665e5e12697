"""`automp optimize IN -o OUT [--precision fp32|fp16|int8] [--calib FILE.npz] [--budget B] [--report PATH]`.

User errors (a corrupt or unsupported model, a calibration file that is truncated or corrupt, or whose data does not
match the inputs, is empty or is not finite, int8 without --calib, a missed budget, an output path that cannot be
written or would overwrite an input: the model, any external-data file it references, the calibration file) print one
line naming the problem and return 1; nothing is written in that case. Output paths are checked before any
work, and outputs are written atomically, so a failed write (a full disk) leaves an existing file at OUT as it was.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import zipfile
import zlib
from typing import Sequence

import numpy as np

from automp.argtypes import run_main

USER_ERRORS = (ValueError, TypeError, OSError, NotImplementedError, RuntimeError)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="automp optimize", description="Optimize an ONNX model for deployment.")
    p.add_argument("input", metavar="IN", help="ONNX model to optimize")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="where to write the optimized ONNX model")
    p.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "int8"],
                   help="weights and compute: fp32 (graph passes only; default), fp16 (by the training op lists), "
                        "or int8 (post-training quantization; needs --calib)")
    p.add_argument("--calib", metavar="FILE.npz", default=None,
                   help="calibration inputs: one batch-first array per model input, keyed by input name "
                        "(required for int8; used to measure the error for all precisions)")
    p.add_argument("--budget", type=float, default=None,
                   help="max relative output error vs FP32 (int8: layers fall back to float until it holds)")
    p.add_argument("--report", metavar="PATH", default=None, help="write the JSON report here")
    return p


def load_calib(path: str) -> dict[str, np.ndarray]:
    """The arrays of a calibration .npz, each checked to hold samples and only finite numbers: an empty batch
    would only surface as an onnxruntime error about shapes, and a NaN or inf makes every error measured on the data
    NaN or inf, which no budget comparison rejects."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such calibration file")
    try:
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise TypeError(f"{path}: one array, not an .npz of arrays keyed by input name (save with numpy.savez)")
        with data:
            arrays = {k: data[k] for k in data.files}
    except (zipfile.BadZipFile, EOFError, zlib.error) as e:  # a cut-off or damaged zip: no ValueError/OSError
        raise ValueError(f"{path}: not a readable .npz of arrays (truncated or corrupt: {e})") from None
    except (ValueError, OSError) as e:
        raise ValueError(f"{path}: not a readable .npz of arrays ({e})") from None
    for name, arr in arrays.items():
        if arr.ndim == 0 or arr.shape[0] == 0 or arr.size == 0:
            raise ValueError(f"{path}: calibration input {name!r} has shape {arr.shape}, an empty batch (give at "
                             "least one sample, batch first)")
        if np.issubdtype(arr.dtype, np.inexact):
            bad = arr.size - int(np.count_nonzero(np.isfinite(arr)))
            if bad:
                raise ValueError(f"{path}: calibration input {name!r} has {bad} non-finite values (NaN or inf) of "
                                 f"{arr.size}; calibration data must be finite")
    return arrays


def check_paths(args: argparse.Namespace) -> dict[str, str]:
    """Before any work: each output can be written, and none is an input (the write would destroy it: the model, its
    external-data files, the calibration file) or the other output (onnx_io.check_outputs). Returns the files the
    input model reads."""
    from automp.deploy import onnx_io
    return onnx_io.check_outputs({"-o": args.output, "--report": args.report}, args.input,
                                 {"the calibration file": args.calib})


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from automp.deploy import onnx_io, optimize, report

    keep = check_paths(args).values()
    calib = load_calib(args.calib) if args.calib else None
    bar = Progress(console=Console(stderr=True), transient=True)
    task = bar.add_task("calibrating", total=None)

    def progress(done: int, total: int) -> None:
        bar.update(task, completed=done, total=total)

    with bar if args.precision == "int8" else contextlib.nullcontext():
        model, rep = optimize(args.input, precision=args.precision, calib=calib, budget=args.budget,
                              progress=progress, source=args.input)
    onnx_io.save(model, args.output, keep=keep)
    onnx_io.load(args.output, check_runtime=False)  # what we wrote reads back (optimize checked it runs in ORT CPU)
    rep["output"] = args.output
    rep["bytes"]["file"] = os.path.getsize(args.output)
    if args.report:
        report.write(rep, args.report)
    report.print_summary(rep, Console())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_main("automp optimize", build_parser(), _run, USER_ERRORS, argv)


if __name__ == "__main__":
    sys.exit(main())
