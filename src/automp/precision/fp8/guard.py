"""The loss guard of an FP8 run: watch the training loss, keep a non-finite step off the weights, report divergence.

FP8 has a narrow range: a layer whose activations or gradients outgrow its scales can turn a healthy run into one
that diverges. Once the trial has put a model on FP8, `LossWatch` reads every training loss (a 0-dim floating tensor
that `backward` starts from) and reports the first divergence from the recent trend to a callback, which moves the
model back to bf16 for the rest of the run. Then the watch stops: one report per run.

The rules, in the order they are checked, on each loss in the order the backward calls came:
- NONFINITE: the loss is nan or inf, at any time;
- SPIKE: `patience` finite losses in a row above `factor` times the median of the last `window` finite losses (the
  spiking ones are not added to it), once `history` of them exist and that median is positive. One batch's loss can jump
  in a healthy run (a hard batch, in bf16 as well), while a divergence stays up: the defaults (`factor` times the median
  of the last `window` losses, `patience` of two in a row) report the second. A relative bound says nothing about a loss
  that hovers at or below zero: such a loss is watched for non-finite values only.

What is and is not lost:
- A step whose loss is non-finite never updates the weights while the watch is installed, before and after its report:
  the optimizer step after it is turned into a no-op (`skipped_steps`). Only that step's update is lost, and the weights
  stay finite. Every loss observed since that optimizer's last step counts, so one bad micro-batch of an accumulated
  step skips the whole step.
- A finite spike's step has already been applied when the watch reads it: on CUDA the loss reaches the host without a
  wait, so the report can come a step or two later still. The model moves to bf16 from there.

Speed: nothing here waits for the device in a training step. On CUDA each loss is copied, non-blocking, into a pinned
host buffer behind a CUDA event, and the losses whose events have completed are checked at the next backward call or
optimizer step. The skip itself is loss scaling's (automp.scaling.skip.decide), one rule for both: on the device for
torch's fused optimizers, whose `found_inf` argument (the one GradScaler uses) skips the update in the kernel and takes
the step counter back; one host read per step for any other optimizer, and for a fused SGD's first momentum step.

Not watched: backward calls on non-scalar tensors, losses that are tensor subclasses (a DTensor, a fake tensor), losses
given to `torch.autograd.backward` directly, and anything during CUDA graph capture. A loss computed inside a step's
closure (LBFGS) is checked for divergence but cannot skip the step that computes it.

Under torch.distributed (`ranks=True`) every rank must decide alike: a rank that skipped a step the others took would
hold other weights, and a rank that left FP8 alone would run other graphs around the same collectives. So each loss
is summed over the ranks on the device (one scalar all-reduce per backward, queued without a wait) and every rank
judges that mean; and a CUDA loss is checked exactly `LAG` backward calls later, waiting for its copy if it has not
landed (it almost always has: the host rarely runs that far ahead), never as soon as its copy happens to land, which
differs between ranks. Every rank then reports the same divergence at the same call and skips the same steps.
"""
from __future__ import annotations

import math
import statistics
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from automp.scaling import skip
from automp.world import distributed


NONFINITE = "loss-nonfinite"  # rules: tools and reports key on these
SPIKE = "loss-spike"

_installed: LossWatch | None = None  # the one watch patching Tensor.backward, if any
LAG = 2  # under torch.distributed: backward calls between a CUDA loss and its check (see the module docstring)


@dataclass(frozen=True)
class Divergence:
    """The first loss that left the trend."""

    step: int  # index of the backward call (0-based) whose loss diverged
    loss: float
    median: float | None  # the median of the recent finite losses it was compared with
    rule: str  # NONFINITE or SPIKE

    def as_dict(self) -> dict:
        """Strict-JSON safe: a non-finite loss is written as the string "nan", "inf" or "-inf"."""
        loss = self.loss if math.isfinite(self.loss) else str(self.loss)
        return {"step": self.step, "loss": loss, "median": self.median, "rule": self.rule}


class LossWatch:
    """Watches training losses for divergence and keeps non-finite steps off the weights (see the module docstring)."""

    def __init__(self, on_divergence: Callable[[Divergence], None], *, window: int = 32, history: int = 16,
                 factor: float = 1.5, patience: int = 2, skip_nonfinite: bool = True, ranks: bool = False):
        if not callable(on_divergence):
            raise TypeError(f"on_divergence must be callable, got {type(on_divergence).__name__}")
        if not (isinstance(window, int) and window >= 1):
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        if not (isinstance(history, int) and 1 <= history <= window):
            raise ValueError(f"history must be an int between 1 and window ({window}), got {history!r}")
        if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 1):
            raise ValueError(f"factor must be a finite number > 1, got {factor!r}")
        if not (isinstance(patience, int) and patience >= 1):
            raise ValueError(f"patience must be an int >= 1, got {patience!r}")
        self._on_divergence = on_divergence
        self.patience, self._over = patience, 0  # losses in a row above the bound so far
        self.window, self.history, self.factor = window, history, float(factor)
        self.skip_nonfinite = skip_nonfinite
        self.ranks = ranks and distributed()  # judge the mean loss of every rank, at calls every rank agrees on
        self.steps_seen = 0  # backward calls observed
        self._recent: deque[float] = deque(maxlen=window)  # the last finite losses, oldest first
        self._pending: deque[tuple[int, torch.Tensor, torch.cuda.Event]] = deque()  # CUDA losses on their way
        self._free: list[torch.Tensor] = []  # pinned buffers whose copies have been read
        self._fired = False
        # The skip: a device count of the non-finite losses observed, and each optimizer's count at its last step.
        self._bad_total: torch.Tensor | None = None
        self._bad_at_step: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._our_found_inf: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._device_skips: torch.Tensor | None = None  # sum of the found_inf flags set, read when asked for
        self._host_skips = 0
        self._undo: Callable[[], None] | None = None

    @property
    def fired(self) -> bool:
        """True once a divergence has been reported; the watch then checks no more losses."""
        return self._fired

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps turned into no-ops because a loss observed since that optimizer's last step was non-finite.
        Reading it waits for the device when a fused optimizer's step was decided there."""
        device = 0 if self._device_skips is None else int(self._device_skips.item())
        return self._host_skips + device

    def observe(self, loss: torch.Tensor) -> None:
        """One scalar loss that backward starts from. On CUDA it is checked once its copy has reached the host (at a
        later observe, optimizer step or flush); elsewhere at once."""
        step = self.steps_seen
        self.steps_seen += 1
        loss = loss.detach()
        if self.ranks:
            loss = loss.to(torch.float32, copy=True)
            torch.distributed.all_reduce(loss)
            loss /= torch.distributed.get_world_size()
        if self.skip_nonfinite:
            bad = (~torch.isfinite(loss)).to(torch.int32)
            total = self._bad_total
            self._bad_total = bad if total is None else total + bad.to(total.device, non_blocking=True)
        if self._fired:
            return
        if loss.is_cuda:
            buf = self._free.pop() if self._free else torch.empty((), dtype=torch.float32, pin_memory=True)
            buf.copy_(loss.to(torch.float32), non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(loss.device))
            self._pending.append((step, buf, event))
            self._drain_ready()
        else:
            self._drain(wait=True)
            self._check(step, float(loss))

    def flush(self) -> None:
        """Check every pending loss, waiting for their copies."""
        self._drain(wait=True)

    def install(self) -> Callable[[], None]:
        """Patch torch.Tensor.backward to observe each scalar loss, and register global optimizer step hooks for the
        skip. Returns the undo: it checks the pending losses, restores Tensor.backward as it was and removes the
        hooks. One watch at a time: installing while one is installed raises RuntimeError."""
        global _installed
        if _installed is not None:
            raise RuntimeError("a LossWatch is already installed: call its undo before installing another")
        own = "backward" in torch.Tensor.__dict__
        saved = torch.Tensor.__dict__.get("backward")
        original = torch.Tensor.backward

        @torch.compiler.disable  # backward runs eagerly anyway; this keeps Dynamo from tracing the watch's bookkeeping
        def backward(tensor, *args, **kwargs):
            if self._undo is not None and _is_loss(tensor) and not _capturing():
                self.observe(tensor)
            return original(tensor, *args, **kwargs)

        torch.Tensor.backward = backward
        handles = [register_optimizer_step_pre_hook(self._pre_step), register_optimizer_step_post_hook(self._post_step)]

        def undo() -> None:
            global _installed
            if self._undo is not undo:
                return
            self._undo = None
            _installed = None
            if torch.Tensor.__dict__.get("backward") is backward:  # else someone patched over it: ours now passes on
                if own:
                    torch.Tensor.backward = saved
                else:
                    del torch.Tensor.backward
            for handle in handles:
                handle.remove()
            for opt, flag in list(self._our_found_inf.items()):
                _drop_found_inf(opt, flag)
            self._our_found_inf.clear()
            self.flush()

        self._undo = undo
        _installed = self
        return undo

    # -- the divergence rules ---------------------------------------------------------------------------------------

    def _drain_ready(self) -> None:
        """Check the CUDA losses due now: those whose copies have landed; under `ranks`, those LAG calls old."""
        if self.ranks:
            self._drain(wait=True, before=self.steps_seen - LAG)
        else:
            self._drain(wait=False)

    def _drain(self, wait: bool, before: int | None = None) -> None:
        """Check the CUDA losses whose copies have landed, in order; with wait, all of them (those of backward calls
        before `before`, if given)."""
        while self._pending and not self._fired:
            step, buf, event = self._pending[0]
            if before is not None and step >= before:
                break
            if wait:
                event.synchronize()
            elif not event.query():
                break
            self._pending.popleft()
            value = buf.item()
            self._free.append(buf)
            self._check(step, value)
        if self._fired:
            self._pending.clear()

    def _check(self, step: int, value: float) -> None:
        if self._fired:
            return
        if not math.isfinite(value):
            median = statistics.median(self._recent) if self._recent else None
            self._fire(Divergence(step, value, median, NONFINITE))
            return
        if len(self._recent) >= self.history:
            median = statistics.median(self._recent)
            if median > 0 and value > self.factor * median:
                self._over += 1
                if self._over >= self.patience:
                    self._fire(Divergence(step, value, median, SPIKE))
                return
        self._over = 0
        self._recent.append(value)

    def _fire(self, divergence: Divergence) -> None:
        self._fired = True  # before the callback: a callback that raises must not be called again
        self._pending.clear()
        self._on_divergence(divergence)

    # -- the skip ---------------------------------------------------------------------------------------------------

    def _pre_step(self, opt: torch.optim.Optimizer, args, kwargs) -> None:
        """Before an optimizer step: turn it into a no-op if a loss observed since its last step was non-finite."""
        total = self._bad_total
        if not self.skip_nonfinite or total is None or _capturing():
            return None
        last = self._bad_at_step.get(opt)
        self._bad_at_step[opt] = total
        if last is total:
            return None  # no loss observed since this optimizer's last step
        if getattr(opt, "found_inf", None) is not None:
            return None  # GradScaler or automp's loss scaling decides this step's skip
        bad = total if last is None else total - last.to(total.device)
        flag = (bad > 0).to(torch.float32)
        how = skip.decide(opt, flag)
        if how == skip.DEVICE:
            self._our_found_inf[opt] = flag
            self._device_skips = flag if self._device_skips is None else self._device_skips + flag.to(
                self._device_skips.device, non_blocking=True)
        elif how == skip.SKIPPED:
            self._host_skips += 1
        return None

    def _post_step(self, opt: torch.optim.Optimizer, args, kwargs) -> None:
        flag = self._our_found_inf.pop(opt, None)
        if flag is not None:
            _drop_found_inf(opt, flag)
        if self._bad_total is not None and not _capturing():
            self._bad_at_step[opt] = self._bad_total  # a closure's losses belong to this step, not the next
        self._drain_ready()


def _is_loss(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.dim() == 0 and t.is_floating_point() and t.requires_grad


def _drop_found_inf(opt: torch.optim.Optimizer, flag: torch.Tensor) -> None:
    if getattr(opt, "found_inf", None) is flag:
        del opt.found_inf


def _capturing() -> bool:
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()

