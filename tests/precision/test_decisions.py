"""The precision pass's decisions on real models, read from its report and from the rewritten graphs."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from automp.precision import lists
from automp.precision.casts import cast_dtype, dtype_of, is_cast

from .helpers import nodes_by_op, rel_err, traced


class Recommender(nn.Module):
    """A huge table looked up for a few ids: casting the table would cost far more than the lookup."""

    def __init__(self, vocab=200_000, dim=32):
        super().__init__()
        self.table = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 512), nn.ReLU(), nn.Linear(512, 1))

    def forward(self, ids):
        return self.mlp(self.table(ids)).squeeze(-1)


class TinyLM(nn.Module):
    def __init__(self, vocab=4096, d=128):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids, targets):
        x = self.emb(ids)
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-1, -2) / 8.0, dim=-1)
        x = x + att @ v
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def test_embedding_of_huge_table_stays_fp32_and_its_matmuls_go_low():
    torch.manual_seed(0)
    m = Recommender()
    _, rec, _ = traced(m, torch.randint(0, 200_000, (256,)))
    emb = nodes_by_op(rec, "embedding", "forward")
    assert emb and all(n["dtype"] == "float32" and n["rule"] == "GATHER_HUGE_TABLE" for n in emb)
    mms = nodes_by_op(rec, "addmm", "forward") + nodes_by_op(rec, "mm", "backward")
    assert mms and all(n["dtype"] == "bfloat16" for n in mms)


def test_embedding_of_small_table_goes_low_when_it_pays():
    torch.manual_seed(0)
    m = Recommender(vocab=64)
    _, rec, _ = traced(m, torch.randint(0, 64, (4096,)))
    emb = nodes_by_op(rec, "embedding", "forward")[0]
    assert emb["dtype"] == "bfloat16" and emb["rule"] == "GATHER_SMALL_TABLE"


def test_transformer_decisions_softmax_ce_fp32_matmuls_low():
    torch.manual_seed(0)
    m = TinyLM()
    ids, tgt = torch.randint(0, 4096, (8, 64)), torch.randint(0, 4096, (8, 64))
    _, rec, _ = traced(m, ids, tgt)
    for op in ("_softmax", "_log_softmax", "nll_loss_forward", "native_layer_norm"):
        found = nodes_by_op(rec, op, "forward")
        assert found, op
        assert all(n["dtype"] == "float32" for n in found), op
    for op in ("bmm", "addmm"):
        found = nodes_by_op(rec, op, "forward")
        assert found and all(n["dtype"] == "bfloat16" for n in found), op
    assert all(n["dtype"] == "bfloat16" for n in nodes_by_op(rec, "bmm", "backward"))
    # the residual add meets the FP32 embedding output: computed FP32, as autocast's promotion would; only the head
    # reads it (in bf16), so it is stored bf16
    adds = nodes_by_op(rec, "add", "forward")
    assert adds and all(n["dtype"] == "float32" and n["storage"] == "bfloat16" for n in adds)
    assert all(n["rule"] == "STORED_LOW" and "promoted" in n["reason"] for n in adds)


def test_each_weight_cast_once_and_no_inverse_pairs_remain():
    torch.manual_seed(0)

    class RoundTrip(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(256, 256), nn.Linear(256, 256)

        def forward(self, x):
            h = self.a(x).float()  # the user's own cast next to ours: an inverse pair to remove
            return self.b(h.to(torch.bfloat16).float())

    _, rec, graphs = traced(RoundTrip(), torch.randn(512, 256))
    joint = graphs[0]
    weights = [n for n in joint.graph.nodes if n.op == "placeholder" and n.name.startswith("primals")]
    for w in weights:
        casts = [u for u in w.users if is_cast(u)]
        assert len(casts) <= 1, f"{w.name} cast {len(casts)} times"
    for n in joint.graph.nodes:
        if is_cast(n) and is_cast(n.args[0]):
            assert dtype_of(n.args[0].args[0]) != cast_dtype(n), f"inverse pair left at {n.name}"
    assert sum(g["casts"]["eliminated"] for g in rec.graphs) > 0


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 1e-2)])
def test_gradients_match_fp32_autograd(dtype, tol):
    torch.manual_seed(1)
    m = TinyLM()
    ids, tgt = torch.randint(0, 4096, (8, 64)), torch.randint(0, 4096, (8, 64))
    ref = TinyLM()
    ref.load_state_dict(m.state_dict())
    ref(ids, tgt).backward()
    loss, rec, _ = traced(m, ids, tgt, dtype=dtype)
    assert any(n["dtype"] == str(dtype).replace("torch.", "") for g in rec.graphs for n in g["nodes"])
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert rel_err(p.grad, q.grad) < tol, (name, rel_err(p.grad, q.grad))


@torch.library.custom_op("automp_test::fp32_only", mutates_args=())
def fp32_only(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@fp32_only.register_fake
def _(x):
    if x.dtype != torch.float32:
        raise TypeError(f"fp32_only has no {x.dtype} kernel")
    return torch.empty_like(x)


class LinearThenFp32Only(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(256, 256)

    def forward(self, x):
        return fp32_only(self.l(x)).sum()


def test_op_without_low_precision_kernel_runs_fp32_and_is_reported(monkeypatch):
    # pretend the op is elementwise so the pass tries low precision; its kernel refuses, so it must fall back
    monkeypatch.setitem(lists._WHY, "fp32_only", (lists.Category.INFER, "test"))

    torch.manual_seed(0)
    m, x = LinearThenFp32Only(), torch.randn(512, 256)
    with torch.no_grad():  # the test op has no autograd formula: an inference graph
        out, rec, _ = traced(m, x, backward=False)
    node = nodes_by_op(rec, "fp32_only")[0]
    assert node["dtype"] == "float32" and node["rule"] == "NO_LOW_KERNEL"
    assert rel_err(out, m(x)) < 1e-2
    assert not rec.fallbacks


def test_unknown_op_is_fp32_and_named():
    with torch.no_grad():
        _, rec, _ = traced(LinearThenFp32Only(), torch.randn(512, 256), backward=False)
    node = nodes_by_op(rec, "fp32_only")[0]
    assert node["dtype"] == "float32" and node["rule"] == "UNKNOWN_OP" and "fp32_only" in node["reason"]


def test_attention_backward_keeps_its_logsumexp_fp32():
    """The fused attention backward reads log-sum-exp as fp32 whatever q/k/v are: casting it would be a wrong read."""
    torch.manual_seed(0)

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(128, 384)

        def forward(self, x):
            q, k, v = self.qkv(x).view(4, 64, 3, 2, 64).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    m = Attn()
    x = torch.randn(4, 64, 128)
    ref = Attn()
    ref.load_state_dict(m.state_dict())
    ref(x).float().square().mean().backward()
    _, rec, graphs = traced(m, x)
    bwd = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "attention" in str(n.target)
           and "backward" in str(n.target)]
    assert bwd, "no fused attention backward in the graph"
    schema_names = [a.name for a in bwd[0].target._schema.arguments]
    lse = bwd[0].args[schema_names.index("logsumexp")]
    assert dtype_of(lse) == torch.float32
    assert dtype_of(bwd[0].args[schema_names.index("query")]) == torch.bfloat16
    for p, q in zip(m.parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) < 2e-2
