"""nn.LSTM inside a root on automp's compiled path: one fused op in low precision (automp.runtime.guards.rnn), not unrolled."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import automp

pytestmark = pytest.mark.usefixtures("fresh_session")


def _compile(**kw):
    automp.enable(inner="eager", path="compile", spec="h100", **kw)


class LSTMLM(nn.Module):
    def __init__(self, vocab=50, d=32):
        super().__init__()
        self.emb, self.rnn, self.head = nn.Embedding(vocab, d), nn.LSTM(d, d, 2, batch_first=True), nn.Linear(d, vocab)

    def forward(self, x):
        h, _ = self.rnn(self.emb(x))
        return self.head(h)


def test_lstm_stays_one_fused_op_and_the_rest_is_compiled():
    torch.manual_seed(0)
    lm, x = LSTMLM(), torch.randint(0, 50, (4, 24))
    _compile(dtype="bf16")
    for _ in range(2):
        out = lm(x)
        F.cross_entropy(out.flatten(0, 1), x.flatten()).backward()
    rep = automp.disable()
    assert out.dtype == torch.float32
    ops = [n["op"] for g in rep["graphs"] for n in g["nodes"]]
    # unrolled over 24 steps x 2 layers the LSTM would be hundreds of matmuls; here only the head's remain
    assert sum(op in ("mm", "addmm") for op in ops) <= 4, sorted(set(ops))
    assert "embedding" in ops and any(op in ("mm", "addmm") for op in ops)  # both sides of the RNN compiled
    assert [f for f in rep["fallbacks"] if f["where"] == "rnn"]
    assert not [f for f in rep["fallbacks"] if f["where"] == "graph break"]


def test_lstm_numerics_stay_close_to_fp32():
    torch.manual_seed(0)
    lm, x = LSTMLM(), torch.randint(0, 50, (4, 24))
    ref = lm(x)
    _compile(dtype="bf16")
    got = lm(x)
    automp.disable()
    assert (got - ref).norm() / ref.norm() < 2e-2  # bf16: 8 mantissa bits, compounded over the recurrence


def test_an_rnn_the_cpu_cannot_run_in_low_precision_runs_fp32_and_the_rest_stays_compiled(monkeypatch):
    """oneDNN builds no bf16 LSTM on a CPU without AVX-512: the RNN runs FP32 as written instead of crashing the run."""
    from automp.runtime.guards import rnn
    monkeypatch.setattr(rnn, "NO_LOW_PRECISION_RNN", set())
    real = nn.LSTM.forward

    def no_bf16_lstm(self, *args, **kwargs):
        if torch.is_autocast_enabled("cpu"):
            raise RuntimeError("could not create a primitive descriptor for the LSTM forward propagation primitive")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(nn.LSTM, "forward", no_bf16_lstm)
    torch.manual_seed(0)
    lm, x = LSTMLM(), torch.randint(0, 50, (4, 24))
    with torch.no_grad():
        ref = lm.double()(x).float()
    lm.float()
    _compile(dtype="bf16")
    out = lm(x)
    assert out.dtype == torch.float32
    assert (out.detach() - ref).norm() / ref.norm() < 0.05  # bf16 embedding and head around an FP32 LSTM
    assert rnn.NO_LOW_PRECISION_RNN == {("cpu", torch.bfloat16)}
