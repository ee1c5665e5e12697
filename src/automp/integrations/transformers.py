"""automp inside a Hugging Face Trainer: one callback instead of `bf16=True`.

    trainer = Trainer(model, args, train_dataset=data, callbacks=[AutoMPCallback(dtype="bf16")])
    trainer.train()     # the Trainer's own precision stays FP32; automp chooses, the report lands in output_dir

Why a callback: the Trainer builds its model, optimizer and data loader itself, and a user who cannot wrap the
script in `automp run` (a notebook, a scheduler starting `python -m`) still owns its argument list. automp is enabled
at `on_train_begin`, before the first forward (the Trainer has built its optimizer by then, which automp leaves as
it is), and disabled at `on_train_end`, which writes the report (`output_dir/automp-report.json` unless the config
names another path) and logs the same one-line summary `automp run` prints. Under `accelerate launch` or torchrun
each process enables its own session, as `automp run` does; rank 0 writes the report's path, the others their own
file beside it.

The Trainer's own autocast (`bf16=True`, `fp16=True`) would run under automp's choice and undo it, and its
`torch_compile=True` would compile the model before automp times the ways to run it: both are refused with one line.
"""
from __future__ import annotations

from typing import Any

from transformers import TrainerCallback
from transformers.utils import logging

from automp.config import AutoMPConfig
from automp.integrations.bracket import REPORT_NAME, config_of, finish, start

__all__ = ["AutoMPCallback", "REPORT_NAME"]
_logger = logging.get_logger("automp")


class AutoMPCallback(TrainerCallback):
    """automp for the length of `trainer.train()`. `config` and keyword `overrides` as for automp.enable (e.g.
    `AutoMPCallback(dtype="fp8")`); the report goes to `config.report`, else `TrainingArguments.output_dir`. The
    trial's status line is off (`quiet`) unless asked for: the Trainer draws its own progress bar."""

    def __init__(self, config: AutoMPConfig | None = None, **overrides: Any) -> None:
        self.config = config_of(config, overrides)
        self.report: dict[str, Any] | None = None  # the last run's report, once train() has ended
        self._on = False

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        clash = [name for name in ("bf16", "fp16", "torch_compile") if getattr(args, name, False)]
        if clash:
            raise ValueError(f"AutoMPCallback: TrainingArguments({', '.join(f'{n}=True' for n in clash)}) would run "
                             f"the Trainer's own {'autocast' if clash != ['torch_compile'] else 'compile'} on top of "
                             f"automp's choice; leave {' and '.join(clash)} False")
        start(self.config, args.output_dir, "AutoMPCallback")
        self._on = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._on:
            return
        self._on = False
        self.report, line = finish(self.config)
        _logger.warning(line)
