"""FP32 eager ruled out before it runs, by a lower bound of its iteration measured on the low-precision eager path.

FP32 eager (the script as written) has the largest activations of any candidate, so timing it is what sets a trial's
peak memory: GPT-2 124M (B8, T1024) peaked at about twice the hand-written bf16 loop's memory in its trial. The
GEMM-rate gap alone cannot rule it out: a launch-bound script (a 3-layer MLP on a fast GPU) runs fastest as written, and
automp must never be slower than that. So the gap is applied to the GEMMs the script measurably runs. During the
low-precision eager path's first, untimed iteration (Route.EAGER_LOW, warmed up before FP32 eager), the dense GEMMs of
the roots' forward calls are counted (FLOPs from torch.utils.flop_counter's own formulas), and so are the backward GEMMs
seen to run before the iteration ends. Then

    t_lb = (F_forward + F_backward) / R_fp32

with R_fp32 the fastest FP32 GEMM rate the device's calibration measured (automp.precision.calibrate, any size).
It bounds FP32 eager's iteration from below:
- the script as written runs the same GEMMs on the same shapes in FP32: autocast changes their dtype, not which run;
- a backward GEMM counts only where its node was seen to compute the gradient of a GEMM operand (a node hook), and
  the gradient of a dense mm/addmm/bmm/baddbmm operand is a GEMM of the forward's FLOPs (grad_a = g b^T,
  grad_b = a^T g); a backward that never runs, or that `torch.autograd.grad` restricts, adds nothing;
- only dense cuBLAS GEMMs count, at the rate the calibration measured for exactly those (with TF32 off). Convolutions
  are left out (cuDNN runs FP32 convolutions in TF32 by default, and Winograd and FFT algorithms do fewer
  multiplications than the count), so are attention kernels (the memory-efficient one may run FP32 on tensor cores),
  sparse operands, GEMMs inside higher-order operators, and every other op: all of them take time too;
- a timed sample spans the device's work between two synchronizations, so it is no shorter than its GEMMs.
It assumes what the trial assumes of every path: iterations alike (the same shapes each time).

The rule (Trial): FP32 eager is dropped, never run, where t_lb > give_up x t_warm, t_warm being the wall time of low
precision eager's second warm-up iteration (the one after the count), synchronized at both ends like a trial's samples.
Not the counted first one: it carries what a process pays once (cuBLAS set-up, kernel loading, allocator growth) and the
count's own host time; GPT-2's first took many times its bound, and ruled nothing out (BENCHMARKS.md, "The FP32 bound in
the trial"). The second is still a warm-up, taken to be no shorter than the path's later samples, and those are no
shorter than the trial's best median. So FP32's samples would have measured above give_up x the best median: on CUDA,
where CUDA graphs are recorded after the first round, that drops an eager path after its first sample (TrialConfig), and
in any trial it keeps FP32 from winning. The first round's wider give_up_first is for a one-off slow sample; t_lb is no
sample. Under torch.distributed there is no bound: nothing is dropped early there (ranks.for_ranks), as a drop would
depend on one rank's timings. The rate is the one figure that errs the other way (a measured median, not a peak): the
distance between give_up (1.3) and the 3% by which FP32 keeps its verdict (fp32_margin) covers a GEMM running up to 26%
faster than the calibration saw.

Preconditions, else FP32 is timed as before (and the verdict's `bounds` say why): FP32 matmuls run in plain FP32
(TF32 on, they run at a rate the calibration did not measure), and every floating parameter of a counted root is FP32
(a frozen bf16 base with FP32 adapters runs the base's GEMMs in bf16 even as written). A module that casts to low
precision inside its own forward is outside what "FP32 eager" means, and outside this bound.
"""
from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

T = TypeVar("T")
aten = torch.ops.aten

# The GEMMs counted, and where their two matrix operands sit among their tensor arguments (their autograd node's
# gradients come in the same order).
MATRICES = {aten.mm: (0, 1), aten.addmm: (1, 2), aten.bmm: (0, 1), aten.baddbmm: (1, 2)}

# What a trial's bound said about FP32 eager (Verdict.bounds[Route.FP32.value]["rule"]).
RULED_OUT = "fp32-ruled-out-flops"  # t_lb > give_up x t_first: never run
NOT_RULED_OUT = "fp32-not-ruled-out-flops"  # the bound was not enough: timed as usual
UNCOUNTED = "fp32-flops-uncounted"  # counting failed (the error is recorded): timed as usual
REDUCED_PRECISION = "fp32-matmuls-not-plain-fp32"  # TF32 (or lower) FP32 matmuls: no rate to bound them with
MIXED_PARAMETERS = "fp32-mixed-parameters"  # a root with non-FP32 floating parameters: runs low precision as written


def plain_fp32_matmuls() -> bool:
    """Whether FP32 matmuls run in FP32 (not TF32): the precision automp.precision.calibrate measured them in."""
    return torch.backends.cuda.matmul.fp32_precision in ("ieee", "none")


class GemmCount:
    """The GEMM FLOPs of the roots' forward calls in one interval of a trial, and of the backward GEMMs seen to run.
    `run` can never raise on the count's account: a failure is recorded (`error`), and the forward runs as it
    would have."""

    def __init__(self) -> None:
        self.forward = 0.0
        self.backward = 0.0  # added by autograd node hooks while the backward runs
        self.error: str | None = None
        self.mixed = False

    def run(self, module: torch.nn.Module, forward: Callable[[], T]) -> T:
        """forward(): a call of `module`, counted."""
        if any(p.is_floating_point() and p.dtype != torch.float32 for p in module.parameters()):
            self.mixed = True
        if self.error is not None or self.mixed:
            return forward()
        with _Counting(self):
            return forward()

    def gemm(self, func: Any, args: tuple, kwargs: dict, out: Any) -> tuple[Any, float, list] | None:
        """Count one GEMM; what to hook for its backward (its output, FLOPs, the operands that need a gradient),
        if any."""
        positions = MATRICES[func.overloadpacket]
        operands = [args[i] for i in positions]
        if any(m.layout != torch.strided for m in operands):  # a sparse GEMM does fewer FLOPs than 2mnk
            return None
        flops = float(flop_registry[func.overloadpacket](*args, **kwargs, out_val=out))
        self.forward += flops
        needs = [(i, m.shape) for i, m in zip(positions, operands) if m.requires_grad]
        return (out, flops, needs) if needs and torch.is_grad_enabled() and isinstance(out, torch.Tensor) else None

    def backward_ran(self, flops: float, needs: list) -> Callable[..., None]:
        """A node hook: each operand whose gradient the node computed is one backward GEMM of `flops`."""
        def hook(grad_inputs: tuple, grad_outputs: tuple) -> None:
            try:
                done = sum(1 for i, shape in needs if i < len(grad_inputs) and grad_inputs[i] is not None
                           and grad_inputs[i].shape == shape)
                self.backward += done * flops
            except Exception:  # noqa: BLE001 - a hook must not fail the script's backward; uncounted is a smaller bound
                pass
        return hook


class _Counting(TorchDispatchMode):
    """Counts the GEMMs dispatched inside it into a GemmCount. A GEMM's output gets its autograd node only after the
    op returns, so the node is hooked at the next op (or at the end): before any in-place op can rebase it.

    Not FlopCounterMode itself around the forward: an error of its own (a formula, its module tracker) would reach the
    script as the forward's, halfway through it, and the forward cannot be run again without repeating what already
    ran (BatchNorm statistics, random draws). Its formulas (flop_registry) are called here, each inside a try."""

    supports_higher_order_operators = True  # run as they come; a GEMM inside one goes uncounted (the bound holds)

    def __init__(self, count: GemmCount) -> None:
        super().__init__()
        self.count = count
        self.pending: list[tuple[Any, float, list]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self._hook_pending()
        out = func(*args, **kwargs)
        if self.count.error is None and getattr(func, "overloadpacket", None) in MATRICES:
            try:
                hooked = self.count.gemm(func, args, kwargs, out)
                if hooked is not None:
                    self.pending.append(hooked)
            except Exception as e:  # noqa: BLE001 - whatever the count meets, the forward goes on untouched
                self.count.error = f"{type(e).__name__}: {e}"[:200]
        return out

    def __exit__(self, *exc: Any) -> Any:
        self._hook_pending()
        return super().__exit__(*exc)

    def _hook_pending(self) -> None:
        pending, self.pending = self.pending, []
        for out, flops, needs in pending:
            try:
                if out.grad_fn is not None:
                    out.grad_fn.register_hook(self.count.backward_ran(flops, needs))
            except Exception:  # noqa: BLE001 - unhooked: its backward is not counted, a smaller bound
                pass


class Fp32Floor:
    """The bound's collaborator in a trial (Trial.floor): opens a count per interval and judges FP32 eager by it.
    tflops: the device's fastest calibrated FP32 GEMM rate (starts.CalibratedCandidates.fp32_tflops)."""

    def __init__(self, tflops: float) -> None:
        self.tflops = tflops

    def open(self) -> GemmCount:
        return GemmCount()

    def judge(self, count: GemmCount, counted: int, seconds: float, iterations: int, factor: float,
              against: str) -> tuple[dict[str, Any], str | None]:
        """The record of what the count says about FP32 eager, and the note a verdict's reason gets (None: the
        record alone). count: the GEMMs of `counted` iterations; seconds: the wall time of the `iterations` after
        them, on the path named `against`; factor: TrialConfig.give_up."""
        if count.error is not None:
            return {"rule": UNCOUNTED, "error": count.error}, (f"FP32 eager's GEMMs could not be counted "
                                                               f"({count.error}): it is timed")
        if count.mixed:
            return {"rule": MIXED_PARAMETERS}, None
        if not plain_fp32_matmuls():
            return {"rule": REDUCED_PRECISION}, None
        n = max(1, counted)  # per iteration
        flops, second = (count.forward + count.backward) / n, seconds / max(1, iterations)
        bound = flops / (self.tflops * 1e12)
        ruled_out = bound > factor * second
        record = {"rule": RULED_OUT if ruled_out else NOT_RULED_OUT, "forward_gemm_flops": count.forward / n,
                  "backward_gemm_flops": count.backward / n, "fp32_tflops": self.tflops, "bound_ms": 1e3 * bound,
                  "against": against, "against_ms": 1e3 * second, "factor": factor}
        if not ruled_out:
            return record, None
        return record, (f"FP32 eager not run: its GEMMs ({flops:.3g} FLOP per iteration) take at least "
                        f"{1e3 * bound:.1f} ms at this device's fastest FP32 GEMM rate ({self.tflops:.3g} TFLOP/s), "
                        f"over {factor:g}x {against}'s second warm-up iteration ({1e3 * second:.1f} ms)")
