"""`automp` command line.

Each sub-command imports its implementation lazily so that `automp run` starts as fast as `python` would and a
missing optional piece (say, onnxruntime for `optimize`) only breaks the command that needs it.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from automp import __version__
from automp.argtypes import int_at_least
from automp.config import PATHS


def _add_precision_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", choices=["auto", "fp16", "bf16", "fp8"],
                   help="low-precision dtype; auto = bf16 where supported, else fp16; fp8 = bf16 with FP8 linear "
                        "layers where measured to pay and accurate (needs compute capability 8.9+: Ada, Hopper)")
    p.add_argument("--fp8-recipe", default=None, choices=["tensorwise", "rowwise", "auto"],
                   help="FP8 scaling under --dtype fp8: one scale per tensor (default, fastest), per row, or auto: "
                        "per layer, the recipe measured to gain most where it stays accurate")
    p.add_argument("--fp8-keep", default=None, metavar="PATTERNS",
                   help="under --dtype fp8, linear layers kept bf16 whatever their measurements: comma-separated "
                        "glob patterns over layer names, such as lm_head or '*.self_attn.*' (default: "
                        "$AUTOMP_FP8_KEEP, else none)")
    p.add_argument("--no-fp8-all-gather", dest="fp8_all_gather", action="store_false", default=None,
                   help="under --dtype fp8 with FSDP2, all-gather the FP8 layers' weights in FSDP2's own dtype "
                        "instead of FP8")
    p.add_argument("--fp8-output-layer", dest="fp8_output", action="store_true", default=None,
                   help="under --dtype fp8, let the model's output layer (its last linear layer: the LM head) run FP8 "
                        "too where measured to pay (default: kept bf16, as FP8 there slowed learning)")
    p.add_argument("--loss-scale", default="dynamic",
                   help="dynamic | off | a constant such as 1024 (only matters for fp16)")
    p.add_argument("--report", default=None,
                   help="write the precision report JSON here (under torchrun, rank 0 writes this path and rank N "
                        "writes <stem>.rankN<suffix> beside it)")
    p.add_argument("--path", default=None,
                   choices=list(PATHS),
                   help="auto: time automp's compiled pass, low-precision eager, stock Inductor under autocast (with "
                        "and without CUDA graphs) and FP32 in the first iterations and keep the fastest (cached per "
                        "model and device; default: the environment's, else auto); or force one")
    p.add_argument("--fuse-siblings", dest="fuse_siblings", action="store_true", default=None,
                   help="run linear layers that read the same input (query/key/value, gate/up) as one GEMM on the "
                        "compiled paths (experimental: slower than unjoined where measured, BENCHMARKS.md; default: "
                        "the environment's AUTOMP_FUSE_SIBLINGS, else off)")
    p.add_argument("--fuse-linear-ce", dest="fuse_linear_ce", action="store_true", default=None,
                   help="compute an output layer and its cross-entropy a block of rows at a time on the "
                        "compiled paths (experimental: slower than Inductor's own graph where measured, BENCHMARKS.md; "
                        "default: the environment's AUTOMP_FUSE_LINEAR_CE, else off)")
    p.add_argument("--no-causal-attention", dest="causal_attention", action="store_false", default=None,
                   help="keep a causal mask the model builds as a tensor (default: hand it to attention as "
                        "is_causal on the compiled paths, which skips the masked half)")
    p.add_argument("--no-fuse-optimizers", dest="fuse_optimizers", action="store_false",
                   help="keep torch's Adam/AdamW on the implementation the script chose (default: switch those "
                        "left at their defaults to fused=True on CUDA)")
    p.add_argument("--keep-grads", dest="release_grads", action="store_false",
                   help="keep the last step's gradients until the script's own zero_grad (default: where it sets "
                        "them to None after its forward, set them to None as the forward starts)")
    p.add_argument("--no-tune-cudnn", dest="tune_cudnn", action="store_false",
                   help="leave torch.backends.cudnn.benchmark as the script set it (default: time it off and on once "
                        "the paths are chosen, keep it on only if it measured faster)")
    p.add_argument("--no-tune-layout", dest="tune_layout", action="store_false",
                   help="leave eager convolutions in the script's memory layout (default: time channels_last "
                        "activations against it once the paths are chosen, keep them only if they measured faster)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="never replay the compiled graphs as CUDA graphs (default: time them in the trial, for a "
                        "single module on CUDA; they take a memory pool of their own)")
    p.add_argument("--quiet", dest="quiet", action="store_true", default=None,
                   help="no live status line on the terminal while the first iterations time the candidate paths "
                        "(the summary at exit stays)")


_positive_int = int_at_least(1)  # a bad count is a usage error, not a traceback from the training loop


def _cmd_run(args: argparse.Namespace) -> int:
    from automp.config import AutoMPConfig
    from automp.launcher import run_script
    try:  # a bad value (--loss-scale banana, a bad environment variable) is a usage error, before the script runs
        config = AutoMPConfig.from_cli(args)
    except (ValueError, TypeError) as e:
        print(f"automp run: {e}", file=sys.stderr)
        return 2
    return run_script(args.script, args.args, config)


def _cmd_demo(args: argparse.Namespace) -> int:
    from automp.cli.demo import main as demo_main
    return demo_main(steps=args.steps, device=args.device, dtype=args.dtype, report=args.report)


def _cmd_report(args: argparse.Namespace) -> int:
    from automp.runtime.report import NotAReport, load_saved_report, print_report
    try:
        report = load_saved_report(args.path)
    except NotAReport as e:  # the file named on the command line is the problem: a usage error
        print(f"automp report: {e}", file=sys.stderr)
        return 2
    if args.plot is not None:  # an output it cannot write is said before the report is printed, in one line
        from automp.files import check_outputs
        try:
            check_outputs({"--plot": args.plot}, {"the report": args.path})
        except (OSError, ValueError) as e:
            print(f"automp report: {e}", file=sys.stderr)
            return 2
    print_report(report, show_nodes=args.nodes)
    if args.plot is not None:
        from automp.runtime.report_plot import pixel_size, save_plot
        try:
            save_plot(report, args.plot)
        except OSError as e:  # the disk filled or the folder went away since the check: nothing was moved in place
            print(f"automp report: cannot write --plot {args.plot}: {e.strerror or e}", file=sys.stderr)
            return 1
        width, height = pixel_size(report)
        print(f"automp report: wrote {args.plot} ({width} x {height} pixels)")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    import importlib
    suite = importlib.import_module(f"automp.bench.suites.{args.suite}")
    return int(suite.main(args.rest) or 0)


def _cmd_optimize(args: argparse.Namespace) -> int:
    from automp.deploy.cli import main as optimize_main
    return int(optimize_main(args.rest) or 0)


def _cmd_llm(args: argparse.Namespace) -> int:
    if args.rest[:1] == ["bench"]:  # a benchmark suite: automp.llm does not import automp.bench, the command does
        from automp.bench.suites.llm import main as bench_main
        return int(bench_main(args.rest[1:]) or 0)
    from automp.llm.cli import main as llm_main  # imports torch: only when `automp llm` runs
    return int(llm_main(args.rest) or 0)


def _cmd_protect(args: argparse.Namespace) -> int:
    from automp.protect.cli import main as protect_main
    return int(protect_main(args.rest) or 0)


# Sub-commands whose own parser owns every option, before or after the positionals (and -h): main() hands them the
# rest of the command line untouched instead of letting argparse.REMAINDER drop or misread a leading option.
_PASSTHROUGH = {"optimize": _cmd_optimize, "llm": _cmd_llm, "protect": _cmd_protect}


def _rest(p: argparse.ArgumentParser, help: str) -> None:
    """The command line after a sub-command's own arguments, possibly empty: argparse marks a REMAINDER positional
    required and names it in its "required" error, which would read as if something were missing."""
    p.add_argument("rest", nargs=argparse.REMAINDER, help=help).required = False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="automp", description="Automatic reduced precision for PyTorch")
    parser.add_argument("--version", action="version", version=f"automp {__version__}",
                        help="print automp's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="what to do (`automp COMMAND --help` for its options)")

    p = sub.add_parser("run", help="run an unmodified training script in mixed precision (like `python SCRIPT`)")
    _add_precision_args(p)
    p.add_argument("script", help="the training script, run as `python SCRIPT` would run it")
    p.add_argument("args", nargs=argparse.REMAINDER,
                   help="the script's own arguments, passed on unchanged").required = False  # see _rest
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("demo", help="train built-in models FP32 vs automp side by side")
    p.add_argument("--steps", type=_positive_int, default=80,
                   help="training steps per model (>= 1); automp times its paths in the first 20-75")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp16", "bf16"],
                   help="low-precision dtype; auto = bf16 where supported, else fp16")
    p.add_argument("--report", default="automp-demo-report.json",
                   help="write the precision report JSON, with the demo's results, here (default: %(default)s; "
                        "'' writes none)")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("report", help="print a saved precision report")
    p.add_argument("path", help="the report JSON written by `automp run --report` or `automp demo`")
    p.add_argument("--nodes", action="store_true", help="list every node, not only the summary")
    p.add_argument("--plot", default=None, metavar="OUT.png",
                   help="also draw the decisions as a PNG here: each module's candidate step times and, under FP8, "
                        "every layer's predicted gain against its measured error with the thresholds")
    p.set_defaults(func=_cmd_report)

    suites = ["kernels", "train", "convergence", "deploy", "deploy_gpu", "sparsity", "distill", "zoo", "fp8", "fp8_parity",
              "dist", "linear_ce", "integrations", "llm"]
    p = sub.add_parser("bench", help="benchmarks: " + " | ".join(suites) + " (llm = `automp llm bench`)")
    p.add_argument("suite", choices=suites, help="the benchmark suite to run")
    _rest(p, "the suite's own arguments (`automp bench SUITE --help` lists them)")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("optimize", help="optimize a model for deployment (ONNX in, ONNX out)", add_help=False)
    _rest(p, "arguments of `automp optimize` (`automp optimize --help` lists them)")
    p.set_defaults(func=_cmd_optimize)

    p = sub.add_parser("llm", help="weight-only quantized LLMs: quantize | generate | bench", add_help=False)
    _rest(p, "arguments of `automp llm` (`automp llm --help` lists them)")
    p.set_defaults(func=_cmd_llm)

    p = sub.add_parser("protect", help="obfuscate (and optionally encrypt) an ONNX model (ONNX in, ONNX out)",
                       add_help=False)
    _rest(p, "arguments of `automp protect` (`automp protect --help` lists them)")
    p.set_defaults(func=_cmd_protect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in _PASSTHROUGH:  # its own parser owns every option, before or after IN (and -h)
        return _PASSTHROUGH[argv[0]](argparse.Namespace(rest=argv[1:]))
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # reported by the sub-command's parser, whose usage and name fit them (parse_args: by automp's)
        _subparser(parser, args.command).error(f"unrecognized arguments: {' '.join(unknown)}")
    return args.func(args)


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


if __name__ == "__main__":
    sys.exit(main())
