"""AutoMPCallback in a Hugging Face Trainer: the same losses as the same script under `automp run`, the report in
output_dir, every patch undone after train(), and the Trainer's own autocast or compile refused with one line."""
import json
import os
import sys
import textwrap

import pytest
import torch.nn as nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import automp  # noqa: E402
from automp.integrations.transformers import REPORT_NAME, AutoMPCallback  # noqa: E402
from tests.integrations.scripts import AUTOMP_RUN, ROOT, close, losses, run, write_and_import  # noqa: E402

# The script both runs share: a tiny GPT-2 on a fixed token stream, 6 steps, the losses printed as JSON. With
# callbacks it is trained in-process; else it is run under `automp run` (low precision eager forced on both sides).
SCRIPT = textwrap.dedent('''
    import json, os, sys
    import torch
    import transformers

    class Tokens(torch.utils.data.Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(0)
            self.ids = torch.randint(0, 64, (24, 16), generator=g)
        def __len__(self):
            return len(self.ids)
        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    def train(out_dir, callbacks=(), **overrides):
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
        model = transformers.GPT2LMHeadModel(cfg)
        args = transformers.TrainingArguments(
            output_dir=out_dir, max_steps=6, per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1,
            report_to=[], save_strategy="no", use_cpu=True, dataloader_num_workers=0, seed=0, disable_tqdm=True,
            **overrides)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=list(callbacks))
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    if __name__ == "__main__":
        print("LOSSES " + json.dumps(train(sys.argv[1])))
''')


def _script(tmp_path):
    return write_and_import(tmp_path, "train_tiny", SCRIPT)


def test_the_callback_trains_as_automp_run_does_and_undoes_every_patch(tmp_path):
    path, tiny = _script(tmp_path)
    want = losses([sys.executable, *AUTOMP_RUN, str(path), str(tmp_path / "run")], tmp_path)

    call = nn.Module.__call__
    callback = AutoMPCallback(dtype="bf16", path="eager")
    got = tiny.train(str(tmp_path / "cb"), callbacks=[callback])
    assert close(got, want, 6)
    assert not automp.is_enabled() and nn.Module.__call__ is call  # every patch undone after train()
    saved = json.loads((tmp_path / "cb" / REPORT_NAME).read_text())
    assert [c["module"] for c in saved["choices"]] == ["GPT2LMHeadModel"] and saved["dtype"] == "bfloat16"
    assert callback.report["choices"][0]["path"] == saved["choices"][0]["path"] == "low-precision-eager"


@pytest.mark.parametrize("flag", ["bf16", "torch_compile"])
def test_the_trainers_own_autocast_or_compile_is_refused_in_one_line(tmp_path, flag):
    _, tiny = _script(tmp_path)
    with pytest.raises(ValueError, match=f"{flag}=True") as err:
        tiny.train(str(tmp_path / "x"), callbacks=[AutoMPCallback()], **{flag: True})
    assert "\n" not in str(err.value) and not automp.is_enabled()


def test_a_bad_setting_fails_where_the_callback_is_made():
    with pytest.raises((TypeError, ValueError)):
        AutoMPCallback(dtype="int3")


def test_accelerate_launch_runs_automp_run_as_the_shell_does(tmp_path):
    """`accelerate launch -m automp run train.py`, the documented form: one CPU process, the same losses."""
    path, _ = _script(tmp_path)
    want = losses([sys.executable, *AUTOMP_RUN, str(path), str(tmp_path / "run")], tmp_path)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1", "--num_machines",
              "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    assert close(losses([*launch, *AUTOMP_RUN, str(path), str(tmp_path / "launched")], tmp_path), want, 6)


def test_the_example_trains_with_the_callback(tmp_path):
    run([sys.executable, os.path.join(ROOT, "examples", "train_hf_trainer.py"), "--steps", "3", "--out",
         str(tmp_path)], tmp_path)
    assert json.loads((tmp_path / REPORT_NAME).read_text())["choices"][0]["module"] == "GPT2LMHeadModel"


def test_the_status_line_is_off_unless_asked_for():
    """The Trainer draws its own progress bar: no second live line beside it, unless the user asks."""
    assert AutoMPCallback().config.quiet and not AutoMPCallback(quiet=False).config.quiet


def test_the_callback_inside_automp_run_is_refused(tmp_path):
    """Its enable() would replace the session `automp run` (or the script) opened: one of them, not both."""
    _, tiny = _script(tmp_path)
    automp.enable(dtype="bf16", path="eager")
    try:
        with pytest.raises(RuntimeError, match="already enabled"):
            tiny.train(str(tmp_path / "x"), callbacks=[AutoMPCallback()])
        assert automp.is_enabled()  # the session that was there is left as it was
    finally:
        automp.disable()
