"""Output fields the script never reads are detached inside the compiled function (no zero gradient of their size in
the backward), and a detached field read before its backward brings the gradient back: never a missing one."""
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.utils import ModelOutput

import automp
from automp.runtime.outputs import restore_lazily
from automp.runtime.guards.unread_outputs import FieldReads, FieldWatch, detach_unread

from tests.runtime.sessions import inject


@dataclass
class Out(ModelOutput):
    loss: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None


class TinyLM(nn.Module):
    """Returns its loss and its logits, as a transformers model called with labels does."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(50, 16), nn.Linear(16, 50)

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.emb(ids)))
        return Out(loss=F.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits=logits)


pytestmark = pytest.mark.usefixtures("fresh_session")


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50, (4, 12), generator=g), torch.randint(0, 50, (4, 12), generator=g)


def _spy_detaching(monkeypatch) -> list[bool]:
    """Whether each compiled call of the session detached the logits, in call order."""
    from automp.runtime import compiled_paths

    seen = []

    def spy(out, fields):
        res = detach_unread(out, fields)
        seen.append(not res.logits.requires_grad)
        return res

    monkeypatch.setattr(compiled_paths, "detach_unread", spy)
    return seen


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_fields_read_before_compilation_stay_attached_the_rest_are_detached():
    fields = FieldReads()
    out = Out(loss=torch.ones((), requires_grad=True) * 2, logits=torch.ones(3, requires_grad=True) * 3)
    fields.observe(out)
    fields.read.add("loss")
    assert fields.decide() == ("logits",)
    fields.read.add("logits")
    assert fields.decide() == ("logits",)  # fixed at the first compilation
    detached = detach_unread(out, fields)
    assert detached.loss.requires_grad and not detached.logits.requires_grad
    assert detach_unread(out, None) is out and FieldReads().decide() == ()  # nothing seen: nothing detached


def test_read_of_a_detached_field_before_backward_reruns_the_call_and_stops_detaching():
    fields = FieldReads(seen={"loss", "logits"}, read={"loss"})
    fields.decide()
    w = torch.randn(3, requires_grad=True)
    calls = []

    def rerun():
        calls.append(1)
        return Out(loss=(w * 2).sum(), logits=w * 3)

    out = detach_unread(Out(loss=(w * 2).sum(), logits=w * 3), fields)
    out = restore_lazily(out, FieldWatch(out, fields, fields.detach, rerun))
    logits = out.logits
    assert calls == [1] and logits.requires_grad and fields.detach == () and "logits" in fields.reattached
    logits.sum().backward()
    assert torch.allclose(w.grad, torch.full((3,), 3.0))  # the gradient through the field is there


def test_read_after_backward_returns_the_detached_value_without_rerunning():
    fields = FieldReads(seen={"loss", "logits"}, read={"loss"})
    fields.decide()
    w = torch.randn(3, requires_grad=True)
    out = detach_unread(Out(loss=(w * 2).sum(), logits=w * 3), fields)
    out = restore_lazily(out, FieldWatch(out, fields, fields.detach, lambda: pytest.fail("must not rerun")))
    out.loss.backward()
    assert torch.equal(out.logits, (w * 3).detach()) and fields.detach == ("logits",)


def _train(model, steps, read_logits_at=None, lr=0.1):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        ids, labels = _batch(step)
        opt.zero_grad()
        out = model(ids, labels)
        loss = out.loss
        if step == read_logits_at:  # the script starts using the logits in its objective
            loss = loss + 0.1 * out.logits.float().pow(2).mean()
        loss.backward()
        losses.append(loss.item())
        if step == read_logits_at:
            grads = _grads(model).clone()
        opt.step()
    return losses, (grads if read_logits_at is not None else None)


def _enable_trial(monkeypatch):
    """A CPU session whose trial runs the model eagerly once, then compiled (automp's graph pass, run op by op) for
    ten untimed warm-up calls: the order a GPU trial starts with, made deterministic."""
    from automp.runtime.decisions import Route
    from automp.runtime.trial import TrialConfig

    inject(monkeypatch, candidates=lambda device, low: ([Route.EAGER_LOW, Route.COMPILED], "test"),
           trial_config=TrialConfig(warmup={Route.EAGER_LOW: 1, Route.COMPILED: 10}))
    automp.enable(dtype="bf16", inner="eager", spec="h100")


def test_session_detaches_unread_logits_and_gradients_match_when_the_script_starts_reading_them(monkeypatch):
    torch.manual_seed(0)
    model = TinyLM()
    ref_model = TinyLM()
    ref_model.load_state_dict(model.state_dict())
    ref_losses, ref_grads = _train(ref_model, 5, read_logits_at=3)
    _enable_trial(monkeypatch)
    seen = _spy_detaching(monkeypatch)
    losses, grads = _train(model, 5, read_logits_at=3)
    rep = automp.disable()
    # call 0 ran eagerly, calls 1-3 compiled with the logits detached, the read at call 3 re-ran it attached, and
    # call 4 stayed attached
    assert seen[:3] == [True, True, True] and seen[3:] == [False, False]
    assert abs(losses[3] - ref_losses[3]) / abs(ref_losses[3]) < 2e-2  # bf16 matmuls
    assert (grads - ref_grads).norm() / ref_grads.norm() < 3e-2  # the logits' term is in the gradient
    assert rep["unread_outputs"]["TinyLM"]["detached"] == [] and "'logits'" in rep["unread_outputs"]["TinyLM"][
        "reattached"]


def test_report_names_the_detached_fields_while_the_script_never_reads_them(monkeypatch):
    torch.manual_seed(0)
    model = TinyLM()
    _enable_trial(monkeypatch)
    _train(model, 3)
    rep = automp.disable()
    assert rep["unread_outputs"] == {"TinyLM": {"detached": ["logits"]}}


def test_reading_a_detached_field_of_a_call_without_gradients_never_reruns():
    fields = FieldReads(seen={"loss", "logits"}, read={"loss"})
    fields.decide()
    w = torch.randn(3, requires_grad=True)
    with torch.no_grad():  # evaluation: the script reads the logits for its metrics
        out = detach_unread(Out(loss=(w * 2).sum(), logits=w * 3), fields)
        out = restore_lazily(out, FieldWatch(out, fields, fields.detach, lambda: pytest.fail("must not rerun")))
        logits = out.logits
    assert torch.equal(logits, (w * 3).detach()) and fields.detach == ("logits",)  # training keeps detaching


def test_a_later_run_detaches_from_its_first_call_what_the_measured_run_learned(monkeypatch, tmp_path):
    """Run 1: a trial (eager, then compiled, a clock that makes compiled win) settles and caches the verdict with the
    detached fields. Run 2 (same cache): the compiled path from the first call, the logits detached at once."""
    from automp.runtime.decisions import Route
    from automp.runtime.trial import TrialConfig
    from automp.runtime.session import Session

    cost = {Route.EAGER_LOW: 2.0, Route.COMPILED: 1.0}
    now = [0.0]
    run = Session._run

    def timed_run(self, module, root, path, args, kwargs):
        out = run(self, module, root, path, args, kwargs)
        now[0] += cost.get(path, 0.0)
        return out

    monkeypatch.setattr(Session, "_run", timed_run)
    paths = lambda device, low: ([Route.EAGER_LOW, Route.COMPILED], "test")  # noqa: E731
    inject(monkeypatch, candidates=paths, clock=lambda: now[0],
           trial_config=TrialConfig(warmup={Route.EAGER_LOW: 1, Route.COMPILED: 1}, measure=2, block=1))
    torch.manual_seed(0)
    model = TinyLM()
    automp.enable(dtype="bf16", inner="eager", spec="h100", cache_dir=str(tmp_path))
    _train(model, 8)
    first = automp.disable()
    assert [c["path"] for c in first["choices"]] == ["automp-compiled"] and not first["choices"][0]["cached"]

    seen = _spy_detaching(monkeypatch)
    inject(monkeypatch, candidates=paths)  # the second run: the real clock and trial settings
    automp.enable(dtype="bf16", inner="eager", spec="h100", cache_dir=str(tmp_path))
    _train(model, 2)
    second = automp.disable()
    assert second["choices"][0]["cached"] and seen[0] is True
    assert second["unread_outputs"] == {"TinyLM": {"detached": ["logits"]}}


class HeadLM(TinyLM):
    """TinyLM as transformers' language models present themselves: an output layer, labels by keyword."""

    def get_output_embeddings(self):
        return self.head

    def forward(self, ids, labels=None):
        return super().forward(ids, labels)


class Classifier(HeadLM):
    def get_output_embeddings(self):  # transformers' sequence classifiers have none
        return None


def test_a_language_model_given_labels_has_its_logits_guessed_unread():
    from automp.runtime.guards.unread_outputs import guess_unread
    ids, labels = _batch(0)
    assert guess_unread(HeadLM(), {"labels": labels}) == ("logits",)
    assert guess_unread(HeadLM(), {}) == () and guess_unread(HeadLM(), {"labels": None}) == ()
    assert guess_unread(Classifier(), {"labels": labels}) == () and guess_unread(TinyLM(), {"labels": labels}) == ()
    fields = FieldReads()
    assert fields.decide(("logits",)) == ("logits",) and fields.guessed
    seen = FieldReads(seen={"loss", "logits"}, read={"loss", "logits"})
    assert seen.decide(("logits",)) == () and not seen.guessed  # what calls showed wins over the guess


def _train_kw(model, steps, read_logits_at=None):
    """_train with labels by keyword, reading the logits into the loss (before backward) at one step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], None
    for step in range(steps):
        ids, labels = _batch(step)
        opt.zero_grad()
        out = model(ids, labels=labels)
        loss = out.loss if step != read_logits_at else out.loss + 0.1 * out.logits.float().pow(2).mean()
        loss.backward()
        losses.append(loss.item())
        if step == read_logits_at:
            grads = _grads(model).clone()
        opt.step()
    return losses, grads


@pytest.mark.parametrize("read_at", [None, 0])
def test_a_compiled_first_call_detaches_the_guessed_logits_and_a_read_brings_them_back(monkeypatch, read_at):
    """The GPU trial's order (the compiled path first, no call seen before it compiles), on automp's pass run op by
    op: the first compiled call already detaches the logits; a script whose loss reads them gets their gradient."""
    torch.manual_seed(0)
    model, ref_model = HeadLM(), HeadLM()
    ref_model.load_state_dict(model.state_dict())
    ref_losses, ref_grads = _train_kw(ref_model, 3, read_logits_at=read_at)
    automp.enable(dtype="bf16", inner="eager", spec="h100", path="compile")
    seen = _spy_detaching(monkeypatch)
    losses, grads = _train_kw(model, 3, read_logits_at=read_at)
    rep = automp.disable()
    assert seen[0] is True
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) < 2e-2  # bf16 matmuls
    if read_at is None:
        assert seen == [True] * 3 and rep["unread_outputs"]["HeadLM"] == {"detached": ["logits"], "guessed": True}
    else:  # the read re-ran call 0 attached; from then on nothing is detached
        assert seen[1:] == [False] * 3 and (grads - ref_grads).norm() / ref_grads.norm() < 3e-2
        assert rep["unread_outputs"]["HeadLM"]["detached"] == []


def test_a_guessed_field_read_after_backward_is_copied_and_attached_from_the_next_call(monkeypatch):
    """Logits kept for metrics after the step: the guess was wrong, so the kept value is a copy (a CUDA graph's next
    replay would overwrite the detached one) and the later calls return them attached, as without the guess."""
    torch.manual_seed(0)
    model = HeadLM()
    automp.enable(dtype="bf16", inner="eager", spec="h100", path="compile")
    seen = _spy_detaching(monkeypatch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kept = []
    for step in range(3):
        ids, labels = _batch(step)
        opt.zero_grad()
        out = model(ids, labels=labels)
        out.loss.backward()
        opt.step()
        raw = dict.__getitem__(out, "logits")
        kept.append((out.logits, raw))
    rep = automp.disable()
    assert seen == [True, False, False]
    first, raw = kept[0]
    assert first.data_ptr() != raw.data_ptr() and torch.equal(first, raw)  # a copy of the detached value
    assert rep["unread_outputs"]["HeadLM"]["detached"] == []
    assert "after its backward" in rep["unread_outputs"]["HeadLM"]["reattached"]
