"""A torch.compile backend that runs the precision pipeline on AOTAutograd's aten graphs.

We hook the *joint* forward+backward graph, before the partitioner splits it: the pass then sees the backward's
matmuls next to the forward's, one cast of a weight can serve both, and the partitioner saves low-precision
activations for the backward (half the activation memory), exactly as if the user had written the casts.
With Inductor (the default) this is Inductor's own joint-graph hook, so everything after — partitioning, fusion of
our casts into neighbouring kernels, codegen — is stock torch. The "eager" inner compiler runs the rewritten graphs
op by op: no C++/Triton compile, which keeps CPU tests fast and isolates our pass from Inductor.
"""
from __future__ import annotations

import contextlib
import itertools
import traceback
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx

from automp.precision.attention import lower_attention_inputs
from automp.precision.paint import PrecisionConfig
from automp.precision.pipeline import apply_precision, Recorder


class _PrecisionPass:
    """Adapter from Inductor's joint-graph hook (which hands us an fx.Graph) to our GraphModule pass."""

    def __init__(self, config: PrecisionConfig, recorder: Recorder | None, name: Callable[[], str]):
        self.config, self.recorder, self.name = config, recorder, name

    def __call__(self, graph: fx.Graph) -> None:
        apply_precision(graph.owning_module, self.config, self.recorder, self.name())

    def uuid(self) -> None:
        return None  # decisions depend on the device and report state: never serve this graph from a cache


def make_backend(config: PrecisionConfig, recorder: Recorder | None = None, inner: str = "inductor",
                 label: str = "graph", debug: bool = False,
                 rewrite: Callable[[fx.GraphModule, list[Any]], Any] | None = None
                 ) -> Callable[[fx.GraphModule, list[Any]], Callable]:
    """The backend for `torch.compile(..., backend=make_backend(...))`.

    Anything that goes wrong inside our pass or the inner compiler falls back to running that graph as captured,
    in FP32, and the report names the graph and the error: a training run must never die of an optimisation.
    debug: also print the traceback of each such fallback.
    rewrite: `rewrite(gm, example_inputs) -> gm` on the graph Dynamo captured, before anything else (the session's
    graph rewrites: automp.precision.siblings, automp.precision.linear_ce)."""
    counter = itertools.count()

    def name() -> str:
        return f"{label}.{next(counter)}"

    precision_pass = _PrecisionPass(config, recorder, name)
    if inner == "inductor":
        def compile_graph(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
            from torch._inductor.compile_fx import compile_fx
            return compile_fx(gm, example_inputs, config_patches={"joint_custom_pre_pass": precision_pass})
    elif inner == "eager":
        compile_graph = _eager_aot(precision_pass)
    else:
        raise ValueError(f"unknown inner compiler {inner!r}: expected 'inductor' or 'eager'")

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        try:
            if rewrite is not None:
                gm = rewrite(gm, example_inputs)
            if config.dtype != torch.float32:
                lower_attention_inputs(gm, config.dtype)
            return compile_graph(gm, example_inputs)
        except torch._dynamo.exc.RestartAnalysis:
            raise  # Dynamo's own signal to trace again (not a failure): it must reach Dynamo
        except Exception as e:  # noqa: BLE001 - reported FP32 fallback, see docstring
            if recorder is not None:
                recorder.add_fallback(label, f"{type(e).__name__}: {e}".strip().splitlines()[0][:300])
            if debug:
                traceback.print_exc()
            return gm.forward

    return backend


def _eager_aot(precision_pass: _PrecisionPass) -> Callable:
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import default_partition

    def run_eager(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        return make_boxed_func(gm.forward)

    def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any):
        precision_pass(joint.graph)
        return default_partition(joint, joint_inputs, **kwargs)

    def inference(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        precision_pass(gm.graph)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=run_eager, bw_compiler=run_eager, partition_fn=partition,
                        inference_compiler=inference)


def low_dtype(dtype: str, device: torch.device | str | None) -> torch.dtype:
    """'auto' picks bf16 (no loss scaling needed, fp32 range) wherever the hardware has it, else fp16."""
    if dtype in ("fp16", "float16", "half"):
        return torch.float16
    if dtype in ("bf16", "bfloat16"):
        return torch.bfloat16
    if dtype != "auto":
        raise ValueError(f"unsupported dtype {dtype!r}: expected 'auto', 'fp16' or 'bf16'")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


@contextlib.contextmanager
def traceable_attention() -> Iterator[None]:
    """nn.MultiheadAttention's and nn.TransformerEncoder's inference fast path is one opaque fused op the pass
    cannot see into: off while a compiled path runs, so the layers are traced. Only there: the script's own calls
    (FP32 as written, low precision eager) keep it as the user set it, and under autocast torch skips it anyway."""
    mha = getattr(torch.backends, "mha", None)
    if mha is None or not hasattr(mha, "set_fastpath_enabled"):
        yield
        return
    was = mha.get_fastpath_enabled()
    mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        mha.set_fastpath_enabled(was)
