"""A causal mask built inside the graph handed to attention as is_causal (automp.precision.causal_mask): boolean and
additive causal masks are rewritten, once per mask however many calls read it, and the output and every gradient
match the masked graph; masks that read an input (padding), a sliding window, a lower-right mask of fewer queries
than keys, a random mask and one attended with is_causal already are left alone; a mask built under torch.vmap (as
transformers 4.5x builds it) is evaluated with its vmap levels and rewritten too; transformers' Llama and GPT-2,
with their mask built in the graph as Dynamo traces them on older transformers releases, train as before."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from automp.precision.causal_mask import causal_attention, is_causal_mask

B, H, T, D = 2, 3, 7, 12  # odd sizes: no tile of any kernel lines up with them


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _compiled(fn, *args):
    """fn compiled with a backend that applies the pass and runs the graph as it is; (its output, the sites, the
    graphs' attention calls after the pass)."""
    sites, calls = [], []

    def backend(gm, example_inputs):
        gm, found = causal_attention(gm)
        sites.extend(found)
        calls.extend(n for n in gm.graph.nodes if n.op == "call_function" and "scaled_dot" in str(n.target))
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(fn, backend=backend)(*args), sites, calls


def _lower(t_q, t_k, offset=0):
    i = torch.arange(t_q).view(-1, 1) + offset
    j = torch.arange(t_k).view(1, -1)
    return j <= i


class Attention(nn.Module):
    """Layers of self-attention over one mask that the forward builds as `make_mask()` says."""

    def __init__(self, make_mask, layers=2):
        super().__init__()
        self.make_mask = make_mask
        self.proj = nn.ModuleList(nn.Linear(D, 3 * D) for _ in range(layers))

    def forward(self, x, pad=None):
        mask = self.make_mask(x, pad)
        for proj in self.proj:
            q, k, v = proj(x).view(B, T, H, 3 * D // H).transpose(1, 2).chunk(3, dim=-1)
            x = x + F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(B, T, D)
        return x


def _bool_mask(x, pad):
    return _lower(T, T, 0)[None, None].expand(B, 1, T, T)


def _vmapped(x, pad):
    """As transformers 4.5x builds it: a function of (batch, head, query, key) indices, vmapped over each."""
    def attended(b, h, q, k):
        return k <= q
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)):
        attended = torch.vmap(attended, in_dims=dims)
    return attended(torch.arange(B), torch.arange(1), torch.arange(T), torch.arange(T))


def _additive(fill):
    def make(x, pad):
        return torch.zeros(T, T).masked_fill(~_lower(T, T), fill)[None, None]
    return make


@pytest.mark.parametrize("make_mask", [_bool_mask, _additive(float("-inf")), _additive(torch.finfo(torch.float32).min),
                                       _vmapped], ids=["bool", "minus-inf", "lowest", "vmapped"])
def test_a_causal_mask_becomes_is_causal_and_computes_the_same(make_mask):
    torch.manual_seed(0)
    model = Attention(make_mask)
    ref_model = copy.deepcopy(model).double()
    x = torch.randn(B, T, D)
    out, sites, calls = _compiled(model, x)
    ref = ref_model(x.double())
    assert len(sites) == 1 and sites[0].calls == 2  # one mask, read by both layers
    assert [c.kwargs.get("is_causal") for c in calls] == [True, True]
    assert all(c.kwargs.get("attn_mask") is None and len(c.args) == 3 for c in calls)
    out.sum().backward()
    ref.sum().backward()
    assert _rel(out, ref) < 1e-5
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert _rel(p.grad, q.grad) < 1e-5, name
    assert torch._C._functorch.maybe_current_level() is None  # every vmap level the evaluation opened is closed


@pytest.mark.parametrize("make_mask", [
    lambda x, pad: (_lower(T, T)[None] & pad[:, None, :])[:, None],  # reads the input's padding
    lambda x, pad: (_lower(T, T) & ~_lower(T, T, -3))[None, None],  # a sliding window of 3
    lambda x, pad: torch.rand(T, T) > 0.5,  # random
    lambda x, pad: torch.ones(T, T, dtype=torch.bool)[None, None],  # no mask at all, in a tensor
], ids=["padding", "window", "random", "full"])
def test_masks_that_are_not_the_causal_pattern_or_not_constant_are_kept(make_mask):
    torch.manual_seed(0)
    model = Attention(make_mask)
    x, pad = torch.randn(B, T, D), torch.ones(B, T, dtype=torch.bool)
    out, sites, calls = _compiled(model, x, pad)
    assert sites == [] and all(c.kwargs.get("attn_mask") is not None for c in calls)


def test_a_lower_right_mask_of_fewer_queries_than_keys_is_not_upper_left_causal():
    # is_causal aligns the triangle to the upper left; a cache's lower-right mask (queries at the end) differs
    assert not is_causal_mask(_lower(3, 5, offset=2), 3, 5)
    assert is_causal_mask(_lower(3, 5), 3, 5)
    assert not is_causal_mask(_lower(4, 4), 4, 5)  # its sizes are not the scores'
    assert not is_causal_mask(_lower(4, 4).to(torch.int32), 4, 4)


def test_a_mask_passed_by_position_is_rewritten_and_a_call_already_causal_left_alone():
    q = torch.randn(B, H, T, D)
    out, sites, calls = _compiled(lambda q: F.scaled_dot_product_attention(q, q, q, _lower(T, T), 0.0), q)
    ref = F.scaled_dot_product_attention(q.double(), q.double(), q.double(), attn_mask=_lower(T, T))
    assert len(sites) == 1 and calls[0].kwargs == {"attn_mask": None, "dropout_p": 0.0, "is_causal": True}
    assert _rel(out, ref) < 1e-5
    out, sites, calls = _compiled(lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True), q)
    assert sites == [] and calls[0].kwargs.get("is_causal") is True


transformers = pytest.importorskip("transformers")


def _models():
    tiny = dict(vocab_size=300, hidden_size=48, num_hidden_layers=2, num_attention_heads=4)
    return {"llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
                intermediate_size=96, num_key_value_heads=2, attn_implementation="sdpa", **tiny)),
            "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
                n_embd=48, n_layer=2, n_head=4, vocab_size=300, attn_implementation="sdpa",
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))}


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # on a GPU: bf16 autocast, cuDNN/flash kernels


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_transformers_models_with_their_mask_built_in_the_graph_train_as_before(name, device, monkeypatch):
    import transformers.masking_utils as masking
    if not hasattr(masking, "_ignore_causal_mask_sdpa"):
        pytest.skip("this transformers release decides the SDPA mask elsewhere")
    # as older releases do while Dynamo traces: never skip the mask
    monkeypatch.setattr(masking, "_ignore_causal_mask_sdpa", lambda *a, **k: False)
    torch.manual_seed(0)
    model = _models()[name]().to(device)
    ref_model = copy.deepcopy(model)
    ids = torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(1)).to(device)

    def loss(m):  # on a GPU as a bf16 loop runs it: autocast around the compiled call
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            return m(input_ids=ids, labels=ids).loss
    out, sites, calls = _compiled(loss, model)
    ref = loss(ref_model)  # eager: transformers attends with its mask
    assert sum(s.calls for s in sites) == 2 and len(calls) == 2
    assert all(c.kwargs.get("is_causal") is True and c.kwargs.get("attn_mask") is None for c in calls)
    out.backward()
    ref.backward()
    tol, grad_tol = (1e-5, 1e-4) if device == "cpu" else (2e-2, 5e-2)  # on a GPU: bf16 kernels of two kinds
    assert _rel(out, ref) < tol
    for (pname, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert p.grad is not None and _rel(p.grad, q.grad) < grad_tol, pname
