"""FP32 restore of a root module's results: eager for tensors and containers, lazy (on first read) for a transformers
ModelOutput, so an unread half-precision field never costs a cast, yet the script only ever sees FP32."""
import pickle
from dataclasses import dataclass, field
from typing import Optional

import pytest
import torch
from transformers.utils import ModelOutput

from automp.runtime.outputs import (is_lazy_candidate, out_of_pool, restore_float32, restore_lazily,
                                    restore_outside_graph)


@dataclass
class Out(ModelOutput):
    loss: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None
    hidden: Optional[torch.Tensor] = None


def make_out() -> tuple[Out, dict[str, torch.Tensor]]:
    """A ModelOutput with a float32 loss, bf16 logits and fp16 hidden states, and the FP32 values expected."""
    torch.manual_seed(0)
    out = Out(loss=torch.randn(()), logits=torch.randn(2, 5).bfloat16(), hidden=torch.randn(2, 3).half())
    return out, {k: dict.__getitem__(out, k).float() for k in ("loss", "logits", "hidden")}


def stored_dtype(out: Out, name: str) -> torch.dtype:
    """The dtype in the underlying dict, read without going through the lazy class."""
    return dict.__getitem__(out, name).dtype


def test_restore_float32_casts_every_half_in_nested_containers():
    """Both half types turn FP32 wherever they sit; int, FP32 and non-tensors pass through as the same objects."""
    h, b, f, i = torch.randn(3).half(), torch.randn(3).bfloat16(), torch.randn(3), torch.randint(0, 9, (3,))
    out = restore_float32((h, {"b": b, "nested": [f, (i, "s", 1.5)]}, None))
    assert out[0].dtype == out[1]["b"].dtype == torch.float32
    assert torch.equal(out[0], h.float()) and torch.equal(out[1]["b"], b.float())
    assert out[1]["nested"][0] is f and out[1]["nested"][1][0] is i
    assert out[1]["nested"][1][1:] == ("s", 1.5) and out[2] is None


def test_lazy_field_stays_low_precision_until_read():
    """Storage keeps bf16/fp16 until a field is read; reading one field casts that field only."""
    out, want = make_out()
    out = restore_lazily(out)
    assert stored_dtype(out, "logits") == torch.bfloat16 and stored_dtype(out, "hidden") == torch.float16
    logits = out.logits
    assert logits.dtype == torch.float32 and torch.equal(logits, want["logits"])
    assert stored_dtype(out, "logits") == torch.float32  # cast stored back: read once, cast once
    assert stored_dtype(out, "hidden") == torch.float16  # never read: never paid for
    assert isinstance(out, Out)


@pytest.mark.parametrize("read", [
    lambda o: [o["logits"], o["hidden"]],
    lambda o: list(o.to_tuple()[1:]),
    lambda o: list(o.values())[1:],
    lambda o: [v for _, v in o.items()][1:],
    lambda o: [o[1], o[2]],
    lambda o: [o.get("logits"), o.get("hidden")],
], ids=["key", "to_tuple", "values", "items", "index", "get"])
def test_every_way_of_reading_yields_float32(read):
    """Whatever path the script takes to the tensors, it gets FP32 values equal to the originals cast."""
    out, want = make_out()
    logits, hidden = read(restore_lazily(out))
    assert logits.dtype == hidden.dtype == torch.float32
    assert torch.equal(logits, want["logits"]) and torch.equal(hidden, want["hidden"])
    assert out.loss is not None and torch.equal(out.loss, want["loss"])


def test_attribute_and_item_stay_in_step_after_cast():
    """A field read as attribute is the same tensor when read as item (no second cast, no stale bf16 copy)."""
    out = restore_lazily(make_out()[0])
    assert out.logits is out["logits"] is dict.__getitem__(out, "logits")


def test_no_half_fields_returns_output_unchanged():
    """An all-FP32 ModelOutput needs nothing: same object, class not swapped."""
    out = Out(loss=torch.randn(()), logits=torch.randn(2, 5))
    assert restore_lazily(out) is out and type(out) is Out


def test_lazy_class_is_cached_per_class():
    """Two outputs of one class share one lazy twin (no class created per call)."""
    a, b = restore_lazily(make_out()[0]), restore_lazily(make_out()[0])
    assert type(a) is type(b) and type(a) is not Out


def test_non_modeloutput_restored_eagerly():
    """restore_lazily on a tuple casts at once."""
    x = torch.randn(4).bfloat16()
    (y,) = restore_lazily((x,))
    assert y.dtype == torch.float32 and torch.equal(y, x.float())


def test_is_lazy_candidate_only_for_modeloutput():
    """Plain dicts, tuples and tensors are not ModelOutputs; an already lazy output is not a candidate again."""
    t = torch.randn(2).half()
    assert not is_lazy_candidate({"logits": t})
    assert not is_lazy_candidate((t,))
    assert not is_lazy_candidate(t)
    out = make_out()[0]
    assert is_lazy_candidate(out)
    assert not is_lazy_candidate(restore_lazily(out))


def test_restore_outside_graph_leaves_modeloutput_restores_tuple():
    """Inside a graph a ModelOutput is left for the lazy pass (untouched); a tuple is cast now."""
    out = make_out()[0]
    assert restore_outside_graph(out) is out and stored_dtype(out, "logits") == torch.bfloat16 and type(out) is Out
    x = torch.randn(3).half()
    (y,) = restore_outside_graph((x,))
    assert y.dtype == torch.float32 and torch.equal(y, x.float())


def test_lazy_output_pickles_as_original_class():
    """A lazy output must survive pickle (torch.save, DataLoader workers) and come back as the original class, FP32."""
    out, want = make_out()
    back = pickle.loads(pickle.dumps(restore_lazily(out)))
    assert type(back) is Out and torch.equal(back.logits, want["logits"]) and back.logits.dtype == torch.float32


def test_out_of_pool_copies_every_tensor_but_the_fields_kept_in_place():
    """What a CUDA graph returns is copied (its next replay overwrites it), except unread detached fields (GPT-2's
    logits would cost 0.8 GB a step to copy); values, dtypes and gradients are unchanged."""
    w = torch.randn(4, requires_grad=True)
    loss = (w * 2).sum()
    t = torch.randn(3)
    got = out_of_pool((loss, {"x": t}, 1.5))
    assert got[0].data_ptr() != loss.data_ptr() and got[1]["x"].data_ptr() != t.data_ptr() and got[2] == 1.5
    assert torch.equal(got[1]["x"], t)
    got[0].backward()
    assert torch.equal(w.grad, torch.full((4,), 2.0))
    out, _ = make_out()
    logits, loss = dict.__getitem__(out, "logits"), dict.__getitem__(out, "loss")
    same = out_of_pool(out, keep=("logits",))
    assert same is out and dict.__getitem__(out, "logits") is logits
    assert dict.__getitem__(out, "loss") is not loss and torch.equal(dict.__getitem__(out, "loss"), loss)
    assert dict.__getitem__(out, "hidden").dtype == torch.float16  # copied as it was: made FP32 on read, later
    single = torch.randn(2)
    assert out_of_pool(single).data_ptr() != single.data_ptr()


@dataclass
class Plain:
    y: torch.Tensor
    aux: dict
    n: int = 3


@dataclass(frozen=True)
class Frozen:
    y: torch.Tensor
    steps: tuple = ()


@dataclass
class Derived:
    y: torch.Tensor
    scaled: torch.Tensor = field(init=False)

    def __post_init__(self):
        self.scaled = self.y * 2


def test_restore_float32_rebuilds_dataclasses_with_float32_fields():
    """pytree sees a plain @dataclass as one leaf: its fields (nested containers, frozen classes, fields outside
    __init__) are cast all the same, into a new instance, leaving the one the module returned as it was."""
    b = torch.randn(3).bfloat16()
    plain = Plain(b, {"h": [b.half()]})
    frozen = Frozen(b, steps=(Plain(b, {}),))
    derived = Derived(b)
    got_plain, (got_frozen, got_derived) = restore_float32((plain, [frozen, derived]))
    assert type(got_plain) is Plain and got_plain.y.dtype == got_plain.aux["h"][0].dtype == torch.float32
    assert got_plain.n == 3 and torch.equal(got_plain.y, b.float())
    assert type(got_frozen) is Frozen and got_frozen.y.dtype == got_frozen.steps[0].y.dtype == torch.float32
    assert got_derived.y.dtype == got_derived.scaled.dtype == torch.float32
    assert plain.y.dtype == frozen.y.dtype == derived.scaled.dtype == torch.bfloat16  # the originals untouched
    unchanged = Plain(torch.randn(2), {}, 5)
    assert restore_float32(unchanged).y is unchanged.y
    assert restore_lazily(plain).y.dtype == torch.float32


def test_out_of_pool_copies_dataclass_fields():
    t = torch.randn(3)
    got = out_of_pool(Frozen(t, steps=(t,)))
    assert type(got) is Frozen and got.y.data_ptr() != t.data_ptr() and got.steps[0].data_ptr() != t.data_ptr()
    assert torch.equal(got.y, t)


class _ReturnsDataclass(torch.nn.Module):
    def __init__(self, frozen: bool):
        super().__init__()
        self.lin, self.frozen = torch.nn.Linear(8, 8), frozen

    def forward(self, x):
        y = self.lin(x)
        return Frozen(y, steps=(y * 2,)) if self.frozen else Plain(y, {"h": y * 2})


@pytest.mark.parametrize("path", ["eager", "autocast-compile"])
@pytest.mark.parametrize("frozen", [False, True])
def test_a_dataclass_result_reaches_the_script_in_float32(fresh_session, eager_inductor, path, frozen):
    """Under automp a forward returning a @dataclass gives the script FP32 fields (`.numpy()` works), on the eager
    path and on a compiled one, as dicts and tuples do; on the compiled one the casts stay inside the one graph."""
    import automp
    from torch._dynamo.utils import counters
    counters.clear()
    m = _ReturnsDataclass(frozen)
    automp.enable(dtype="bf16", path=path)
    outs = [m(torch.randn(4, 8)) for _ in range(2)]
    automp.disable()
    for out in outs:
        inner = out.steps[0] if frozen else out.aux["h"]
        assert type(out) is type(m.forward(torch.randn(1, 8)))
        assert out.y.dtype == inner.dtype == torch.float32
        out.y.detach().numpy()
    assert not counters["graph_break"]
