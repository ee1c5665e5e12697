import torch
import torch.nn.functional as F

from automp.precision.attention import lower_attention_inputs


def test_attention_gets_low_precision_inputs_and_returns_fp32():
    seen = {}

    def backend(gm, example_inputs):
        lower_attention_inputs(gm, torch.bfloat16)
        seen["gm"] = gm
        return gm.forward

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2

    torch._dynamo.reset()
    q, k, v = (torch.randn(2, 4, 32, 16) for _ in range(3))
    out = torch.compile(f, backend=backend)(q, k, v)
    casts = [n for n in seen["gm"].graph.nodes if n.op == "call_method" and n.target == "to"]
    assert [c.args[1] for c in casts] == [torch.bfloat16] * 3 + [torch.float32]
    assert out.dtype == torch.float32
    ref = f(q.double(), k.double(), v.double())
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-2


def test_attention_already_low_precision_is_left_alone():
    seen = {}

    def backend(gm, example_inputs):
        before = len(gm.graph.nodes)
        lower_attention_inputs(gm, torch.bfloat16)
        seen["delta"] = len(gm.graph.nodes) - before
        return gm.forward

    torch._dynamo.reset()
    q = torch.randn(2, 4, 32, 16, dtype=torch.bfloat16)
    torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q), backend=backend)(q)
    assert seen["delta"] == 0
