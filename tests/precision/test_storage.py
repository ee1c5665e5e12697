"""Compute vs storage precision: which FP32-computed tensors are stored low, and what the partitioner then saves."""
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from automp.precision.casts import dtype_of, is_cast

from .helpers import nodes_by_op, rel_err, traced


def _decision(rec, graphs, match) -> dict:
    """The report entry of the one node of graphs[0] that `match(node)` picks."""
    found = [n for n in graphs[0].graph.nodes if n.op == "call_function" and match(n)]
    assert len(found) == 1, found
    return next(e for g in rec.graphs for e in g["nodes"] if e["name"] == found[0].name)


def _layer_norm_output(n) -> bool:
    return n.target is operator.getitem and n.args[1] == 0 and "native_layer_norm." in str(n.args[0].target)


class NormThenLinear(nn.Module):
    def __init__(self, residual: bool):
        super().__init__()
        self.residual = residual
        self.ln, self.fc = nn.LayerNorm(256), nn.Linear(256, 256)

    def forward(self, x):
        h = self.ln(x)
        return h + self.fc(h) if self.residual else self.fc(h)


def test_layer_norm_read_only_by_a_linear_is_computed_fp32_and_stored_low():
    _, rec, graphs = traced(NormThenLinear(residual=False), torch.randn(512, 256))
    d = _decision(rec, graphs, _layer_norm_output)
    assert (d["dtype"], d["storage"], d["rule"]) == ("float32", "bfloat16", "STORED_LOW")
    stats = [e for e in nodes_by_op(rec, "getitem") if e["name"] != d["name"] and e["rule"] == "TUPLE_ELEMENT"]
    assert len(stats) >= 2 and all(e["storage"] == "float32" for e in stats)  # mean/rstd: read as fp32


def test_layer_norm_feeding_a_residual_add_stays_fp32_in_memory():
    _, rec, graphs = traced(NormThenLinear(residual=True), torch.randn(512, 256))
    d = _decision(rec, graphs, _layer_norm_output)
    assert (d["dtype"], d["storage"]) == ("float32", "float32") and d["rule"] != "STORED_LOW"
    add = nodes_by_op(rec, "add", "forward")[0]
    assert add["rule"] == "PROMOTED_BY_FP32_OPERAND" and add["storage"] == "float32"  # it is the graph's output


class ScoresThenValues(nn.Module):
    """softmax(q k^T) v next to exp(q k^T) v: both FP32 results read only by a matmul."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(64, 192)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        s = q @ k.transpose(-1, -2) / 8.0
        return torch.softmax(s, dim=-1) @ v + torch.exp(s - 4.0) @ v


@pytest.mark.parametrize("dtype,exp_storage", [(torch.float16, "float32"), (torch.bfloat16, "bfloat16")])
def test_softmax_is_stored_low_and_exp_only_where_the_range_holds(dtype, exp_storage):
    low = str(dtype).replace("torch.", "")
    _, rec, graphs = traced(ScoresThenValues(), torch.randn(4, 256, 64), dtype=dtype)
    soft = _decision(rec, graphs, lambda n: "_softmax." in str(n.target))
    assert (soft["dtype"], soft["storage"], soft["rule"]) == ("float32", low, "STORED_LOW")
    exp = _decision(rec, graphs, lambda n: "exp." in str(n.target))
    assert exp["dtype"] == "float32" and exp["storage"] == exp_storage  # exp overflows fp16: stored fp32 there


def test_backward_reads_a_stored_tensor_through_its_low_copy():
    """The softmax backward computes in FP32 but must read the rounded softmax output, never the FP32 one: that is
    what keeps the partitioner from saving the FP32 tensor."""
    _, _, graphs = traced(ScoresThenValues(), torch.randn(4, 256, 64))
    g = graphs[0].graph
    soft = next(n for n in g.nodes if "_softmax." in str(n.target))
    assert [dtype_of(u) for u in soft.users] == [torch.bfloat16] and is_cast(next(iter(soft.users)))
    bwd = next(n for n in g.nodes if "_softmax_backward_data" in str(n.target))
    out = bwd.args[1]
    while not is_cast(out):  # through detach/alias
        out = out.args[0]
    assert dtype_of(out) == torch.float32 and dtype_of(out.args[0]) == torch.bfloat16


def test_graph_outputs_are_never_stored_low():
    class NormOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.fc = nn.LayerNorm(256), nn.Linear(256, 256)

        def forward(self, x):
            h = self.ln(x)
            return self.fc(h), h

    torch.manual_seed(0)
    m, x = NormOut(), torch.randn(512, 256)
    (out, h), rec, graphs = traced(m, x, backward=False)
    assert h.dtype == torch.float32 and torch.equal(h, m.ln(x))  # exactly the FP32 layer norm
    assert all(e["rule"] != "STORED_LOW" for g in rec.graphs for e in g["nodes"])


class MLPBlock(nn.Module):
    def __init__(self, d=256):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(self.ln(x))))


class AttentionBlock(nn.Module):
    """Written-out attention at T=512: the probabilities are 8x the size of q, k, v."""

    def __init__(self, d=256, heads=4):
        super().__init__()
        self.heads, self.ln, self.qkv, self.out = heads, nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        p = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1)
        return x + self.out((p @ v).transpose(1, 2).reshape(b, t, d))


def _saved_for_backward(model, x) -> list[torch.Tensor]:
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    out.float().square().mean().backward()
    return saved


@pytest.mark.parametrize("block", [MLPBlock, AttentionBlock])
def test_inductor_saves_no_fp32_activation_and_gradients_match(block):
    """Through Inductor's min-cut partitioner, as in training: the only FP32 tensors kept for the backward are the
    block's input (the layer norm's backward needs it, and the caller holds it anyway) and per-row statistics."""
    from automp.precision import capture
    from automp.precision import cost
    from automp.precision.paint import PrecisionConfig

    torch.manual_seed(0)
    model, x = block(), torch.randn(2, 512, 256)
    ref = block()
    ref.load_state_dict(model.state_dict())
    fp32_bytes = sum(t.numel() * t.element_size() for t in _saved_for_backward(ref, x))  # eager FP32 training
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=capture.make_backend(
        PrecisionConfig(dtype=torch.bfloat16, spec=cost.SPECS["h100"]), inner="inductor"))
    saved = _saved_for_backward(compiled, x)
    fp32 = [t for t in saved if t.dtype == torch.float32 and t.numel() > x.numel() // 64]
    assert all(t.data_ptr() == x.data_ptr() for t in fp32), [tuple(t.shape) for t in fp32]
    assert any(t.dtype == torch.bfloat16 for t in saved)
    assert sum(t.numel() * t.element_size() for t in saved) < 0.55 * fp32_bytes
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert rel_err(p.grad, q.grad) < 2e-2, (name, rel_err(p.grad, q.grad))
