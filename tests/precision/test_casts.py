"""The cast clean-up pass on hand-built graphs with fake values."""
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from automp.precision.casts import _CONVERT, _OURS, _STORED, eliminate_casts, is_cast


def count_casts(gm):
    """Casts left in the graph, by the test the pipeline counts them with for the report (pipeline._casts_by_part)."""
    return sum(1 for n in gm.graph.nodes if is_cast(n))


def _graph(build, dtype=torch.float32):
    mode = FakeTensorMode()
    g = fx.Graph()
    x = g.placeholder("x")
    with mode:
        x.meta["val"] = torch.empty(4, 8, dtype=dtype)
    out = build(g, x)
    g.output(out)
    for n in g.nodes:
        if n.op == "call_function":
            with mode:
                n.meta["val"] = n.target(*[a.meta["val"] if isinstance(a, fx.Node) else a for a in n.args])
    return fx.GraphModule(torch.nn.Module(), g)


def test_lossless_inverse_pair_and_noop_cast_removed():
    def build(g, x):
        up = g.call_function(_CONVERT, (x, torch.float32))
        down = g.call_function(_CONVERT, (up, torch.bfloat16))  # bf16 -> fp32 -> bf16: exactly x
        same = g.call_function(_CONVERT, (down, torch.bfloat16))  # a no-op
        return g.call_function(torch.ops.aten.relu.default, (same,))

    gm = _graph(build, torch.bfloat16)
    removed = eliminate_casts(gm)
    gm.recompile()
    assert count_casts(gm) == 0 and removed == 3
    x = torch.randn(4, 8).to(torch.bfloat16)
    assert torch.equal(gm(x), torch.relu(x))


def test_users_rounding_round_trip_is_kept():
    def build(g, x):
        down = g.call_function(_CONVERT, (x, torch.bfloat16))
        return g.call_function(_CONVERT, (down, torch.float32))  # x.bfloat16().float(): rounds on purpose

    gm = _graph(build)
    eliminate_casts(gm)
    gm.recompile()
    x = torch.randn(4, 8)
    assert count_casts(gm) == 2 and torch.equal(gm(x), x.bfloat16().float())


def test_duplicate_casts_shared_and_wide_chain_collapsed():
    def build(g, x):
        a = g.call_function(_CONVERT, (x, torch.bfloat16))
        b = g.call_function(_CONVERT, (x, torch.bfloat16))  # same cast twice: share it
        h = g.call_function(_CONVERT, (a, torch.float32))
        c = g.call_function(_CONVERT, (h, torch.float16))  # bf16 -> fp32 -> fp16 == bf16 -> fp16
        return (g.call_function(torch.ops.aten.add.Tensor, (a, b)), c)

    gm = _graph(build)
    eliminate_casts(gm)
    gm.recompile()
    casts = [n for n in gm.graph.nodes if n.target is _CONVERT]
    assert len(casts) == 2  # x->bf16 (shared) and bf16->fp16
    x = torch.randn(4, 8)
    s, c = gm(x)
    xb = x.to(torch.bfloat16)
    assert torch.equal(s, xb + xb) and torch.equal(c, xb.to(torch.float16))


def test_a_stored_low_round_trip_is_kept_and_an_unmarked_one_is_not():
    """x -> bf16 -> fp32 is how the backward reads a tensor stored low (storage.py): removing it would hand the
    backward the FP32 tensor again, and the partitioner would save that."""
    def build(g, x):
        down = g.call_function(_CONVERT, (x, torch.bfloat16))
        up = g.call_function(_CONVERT, (down, torch.float32))
        return g.call_function(torch.ops.aten.relu.default, (up,))

    x = torch.randn(4, 8)
    for marks, kept in (({_OURS: True, _STORED: True}, 2), ({_OURS: True}, 0)):
        gm = _graph(build)
        for n in gm.graph.nodes:
            if n.target is _CONVERT:
                n.meta.update(marks)
        eliminate_casts(gm)
        gm.recompile()
        assert count_casts(gm) == kept
        assert torch.equal(gm(x), torch.relu(x.bfloat16().float()) if kept else torch.relu(x))
