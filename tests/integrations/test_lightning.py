"""The AutoMP precision plugin in a Lightning Trainer: the same losses as the same script under `automp run`, the
report in the Trainer's log_dir, every patch undone after fit(), and Lightning's own precision beside it refused."""
import json
import os
import sys
import textwrap

import pytest
import torch.nn as nn

pytest.importorskip("lightning")

import automp  # noqa: E402
from automp.integrations.lightning import REPORT_NAME, AutoMP, AutoMPFabric  # noqa: E402
from tests.integrations.scripts import AUTOMP_RUN, ROOT, close, losses, run, write_and_import  # noqa: E402

# The script both runs share: an MLP regression in a LightningModule, 8 steps, the per-step losses printed as JSON.
SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    import torch.nn as nn
    import lightning.pytorch as pl

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
            self.losses = []
        def training_step(self, batch, i):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.losses.append(float(loss.detach()))
            return loss
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    def fit(root, plugins=(), **trainer_args):
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(64, 16, generator=g)
        data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
        model = Regression()
        trainer_args = {"logger": True, **trainer_args}
        trainer = pl.Trainer(max_steps=8, accelerator="cpu", devices=1, default_root_dir=root,
                             enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                             plugins=list(plugins), **trainer_args)
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
        return model.losses, trainer

    if __name__ == "__main__":
        print("LOSSES " + json.dumps(fit(sys.argv[1])[0]))
''')


def _script(tmp_path):
    return write_and_import(tmp_path, "fit_tiny", SCRIPT)


def test_the_plugin_trains_as_automp_run_does_and_undoes_every_patch(tmp_path):
    path, tiny = _script(tmp_path)
    want = losses([sys.executable, *AUTOMP_RUN, str(path), str(tmp_path / "run")], tmp_path)
    call = nn.Module.__call__
    plugin = AutoMP(dtype="bf16", path="eager")
    got, trainer = tiny.fit(str(tmp_path / "plugin"), plugins=[plugin])
    assert close(got, want, 8)
    assert not automp.is_enabled() and nn.Module.__call__ is call  # every patch undone after fit()
    saved = json.loads(open(os.path.join(trainer.log_dir, REPORT_NAME)).read())
    assert [c["module"] for c in saved["choices"]] == ["Sequential"] and saved["dtype"] == "bfloat16"
    assert plugin.report["choices"][0]["path"] == "low-precision-eager"


def test_automp_is_on_before_the_first_optimizer_steps_pre_hooks(tmp_path):
    """Lightning calls the optimizer's step with the forward and backward as its closure: the session must be on
    before that step's pre-hooks run, where automp switches Adam to its fused step (at the first step only)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    _, tiny = _script(tmp_path)
    seen = []
    handle = register_optimizer_step_pre_hook(lambda *_: seen.append(automp.is_enabled()))
    try:
        tiny.fit(str(tmp_path / "hooks"), plugins=[AutoMP(dtype="bf16", path="eager")])
    finally:
        handle.remove()
    assert seen and all(seen), seen


def test_without_a_logger_the_report_lands_in_a_root_dir_lightning_never_made(tmp_path):
    """logger=False: Lightning writes nothing and makes no folder, so the report's folder is made by the plugin (the
    report is written after the last step: a missing folder must not fail the run there)."""
    _, tiny = _script(tmp_path)
    root = tmp_path / "not-yet" / "made"
    _, trainer = tiny.fit(str(root), plugins=[AutoMP(dtype="bf16", path="eager")], logger=False)
    assert json.loads((root / REPORT_NAME).read_text())["dtype"] == "bfloat16"


def test_lightnings_own_precision_beside_the_plugin_is_refused(tmp_path):
    _, tiny = _script(tmp_path)
    with pytest.raises(ValueError, match="precision=bf16-mixed"):
        tiny.fit(str(tmp_path / "x"), plugins=[AutoMP()], precision="bf16-mixed")
    assert not automp.is_enabled()


def test_the_status_line_is_off_unless_asked_for():
    assert AutoMP().config.quiet and not AutoMP(quiet=False).config.quiet


FABRIC_SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    import torch.nn as nn
    from lightning.fabric import Fabric

    def train(plugins=(), **fabric_args):
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(64, 16, generator=g)
        y = x.sum(1, keepdim=True).sin()
        fabric = Fabric(accelerator="cpu", devices=1, plugins=list(plugins), **fabric_args)
        net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
        net, opt = fabric.setup(net, torch.optim.Adam(net.parameters(), lr=1e-2))
        losses = []
        for step in range(8):
            xb, yb = x[8 * step:8 * step + 8], y[8 * step:8 * step + 8]
            loss = nn.functional.mse_loss(net(xb), yb)
            opt.zero_grad()
            fabric.backward(loss)
            opt.step()
            losses.append(float(loss.detach()))
        return losses

    if __name__ == "__main__":
        print("LOSSES " + json.dumps(train()))
''')


def test_the_fabric_plugin_trains_as_automp_run_does_and_ends_at_teardown(tmp_path, monkeypatch):
    path, tiny = write_and_import(tmp_path, "fabric_tiny", FABRIC_SCRIPT)
    want = losses([sys.executable, *AUTOMP_RUN, str(path)], tmp_path)
    monkeypatch.chdir(tmp_path)
    call = nn.Module.__call__
    plugin = AutoMPFabric(dtype="bf16", path="eager")
    got = tiny.train(plugins=[plugin])
    assert automp.is_enabled()  # Fabric has no end of training: automp runs until teardown or exit
    plugin.teardown()
    assert not automp.is_enabled() and nn.Module.__call__ is call
    assert close(got, want, 8)
    saved = json.loads((tmp_path / REPORT_NAME).read_text())
    assert saved["choices"][0]["path"] == plugin.report["choices"][0]["path"] == "low-precision-eager"
    with pytest.raises(ValueError, match="precision"):
        tiny.train(plugins=[AutoMPFabric()], precision="bf16-mixed")
    assert not automp.is_enabled()


def test_the_example_fits_with_the_plugin(tmp_path):
    out = run([sys.executable, os.path.join(ROOT, "examples", "train_lightning.py"), "--steps", "4", "--out",
               str(tmp_path)], tmp_path).stdout
    report = next(line for line in out.splitlines() if line.startswith("report: "))[8:]
    assert json.loads(open(report).read())["choices"][0]["module"] == "Sequential"
