"""automp.llm.fuse: q/k/v and gate/up of a quantized Llama as one kernel call each, with the same results, the same
memory and the same saved files; the links break safely when a member's tensors are replaced.

Equality is exact on the CPU (`same`): the fused kernel computes every member's rows with the same code as the
member's own call, and under the Triton interpreter the kernels have one tile configuration whatever N, so not even
the fp32 summation order changes. On CUDA the GEMV autotuner may pick another tile for the fused N (another fp32
summation order: up to 2 fp16 ulps on a fraction of a percent of the outputs, measured on an H100), so there `same`
allows a relative error of 1e-3 (norm-wise), still far below any wrong row or stale input. Compiled vs eager logits
differ by Inductor's own fusion of the elementwise ops (fp16 rounding points), fused or not: that comparison uses the
rel bound of test_quantize (5e-3).
"""
import copy
import dataclasses
import json
import os

import pytest
import torch
from safetensors import safe_open
from torch.utils._python_dispatch import TorchDispatchMode

from automp.llm import cli
from automp.llm.fuse import FusedGroup, fuse_projections, fused_groups
from automp.llm.generate import _ATTR, _decoder, generate
from automp.llm.quantize import QuantLinear, quantize, weight_bytes
from automp.llm.store import META, WEIGHTS, build, load, save
from tests.llm import DEVICE

@pytest.fixture(autouse=True)
def kernel_ops(monkeypatch):
    """These tests count and compare kernel calls: the quantized layers call the kernel ops on the CPU too (their
    CPU default is a torch reference, which makes no op call)."""
    import automp.quant.weight_only as weight_only
    monkeypatch.setattr(weight_only, "FORCE_KERNELS", True)


LAYERS = 2  # tiny-llama: 2 blocks, each with a q/k/v and a gate/up group
# quant_gemv_rows, quant_planes: on CUDA, automp.kernels.crossover may serve a batched product with either
KERNELS = ("quant_gemv", "quant_gemm", "quant_gemv_rows", "quant_planes")


def ids(n: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def logits(model, x):
    with torch.no_grad():
        return model(input_ids=x, use_cache=False).logits


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Fused vs unfused results: bitwise on the CPU, within the GPU autotuner's summation-order noise on CUDA."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a, b) if a.device.type == "cpu" else rel(a, b) < 1e-3


def pair(scheme: str = "int8", name: str = "tiny-llama", **kw):
    """(unfused, fused) quantizations of one model."""
    model = build(name, **kw).to(DEVICE)
    return (quantize(copy.deepcopy(model), scheme, group_size=32, fuse=False),
            quantize(copy.deepcopy(model), scheme, group_size=32))


def state(model) -> dict:
    return dict(model.named_buffers(remove_duplicate=False)) | dict(model.named_parameters(remove_duplicate=False))


class KernelCalls(TorchDispatchMode):
    """Counts the quantized GEMV / GEMM calls (custom ops, so they pass through the dispatcher)."""

    def __init__(self):
        super().__init__()
        self.calls = {k: 0 for k in KERNELS}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in self.calls:
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("scheme,kw", [("int8", {}), ("int4", {}), ("int8", {"attention_bias": True})])
def test_fused_logits_identical_and_fewer_calls(scheme, kw):
    plain, fused = pair(scheme, **kw)
    assert len(fused_groups(fused)) == 2 * LAYERS and fused_groups(plain) == []
    if kw:
        assert fused.model.layers[0].self_attn.q_proj.bias is not None and fused_groups(fused)[0].bias is not None
    for x in (ids(1), ids(5, batch=2, seed=2)):  # GEMV (decode) and GEMM (prefill, batched)
        # on CUDA a shape's first batched call times the kernels that can serve it (kernels/crossover.py), calling
        # each several times: run each model once first, so the counts below are of the forward alone
        logits(plain, x), logits(fused, x)
        with KernelCalls() as unfused_calls:
            ref = logits(plain, x)
        with KernelCalls() as fused_calls:
            out = logits(fused, x)
        assert same(out, ref)
        for counter in (unfused_calls, fused_calls):  # a batched product is one call of the kernel crossover chose
            counter.calls["quant_gemm"] += counter.calls.pop("quant_gemv_rows") + counter.calls.pop("quant_planes")
        kernel = "quant_gemv" if x.numel() == 1 else "quant_gemm"
        assert unfused_calls.calls[kernel] == 7 * LAYERS and fused_calls.calls[kernel] == 4 * LAYERS
    assert all(g.x is None and g.y is None and g.taken == 0 for g in fused_groups(fused))  # nothing held after
    # same memory, same state_dict (names, shapes, values)
    assert weight_bytes(fused) == weight_bytes(plain)
    a, b = state(plain), state(fused)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_members_are_views_of_the_fused_tensors():
    _, q = pair("int4")
    attn = q.model.layers[1].self_attn
    members = [attn.q_proj, attn.k_proj, attn.v_proj]
    group = attn.q_proj._fused
    assert isinstance(group, FusedGroup) and all(m._fused is group for m in members)
    assert not isinstance(group, torch.nn.Module) and not any(isinstance(m, FusedGroup) for m in q.modules())
    assert group.bounds == ((0, 64), (64, 96), (96, 128))  # q: 4 heads x 16, k and v: 2 kv heads x 16
    for name in ("qw", "scales"):
        fused = getattr(group, name)
        assert fused.shape[0] == 128
        for m, (start, _) in zip(members, group.bounds):
            t = getattr(m, name)
            assert t.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
            assert t.data_ptr() == fused.data_ptr() + start * fused.stride(0) * fused.element_size()
            assert t.is_contiguous()
    assert fuse_projections(q) == 0  # idempotent
    assert q.model.layers[1].self_attn.q_proj._fused is group


def test_call_order_and_other_inputs():
    plain, fused = pair("int8")
    p, f = plain.model.layers[0].self_attn, fused.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, 64, generator=gen).half().to(DEVICE)
    other = torch.randn(1, 1, 64, generator=gen).half().to(DEVICE)
    with torch.no_grad():
        assert same(f.k_proj(x), p.k_proj(x))   # k first: computes the group, keeps it
        assert same(f.q_proj(x), p.q_proj(x))
        assert same(f.q_proj(x), p.q_proj(x))   # twice: still the cached slice
        group = f.q_proj._fused
        assert group.x is x
        assert same(f.v_proj(other), p.v_proj(other))  # another input: computed for it
        assert group.x is other
        assert same(f.q_proj(other), p.q_proj(other)) and same(f.k_proj(other), p.k_proj(other))
        assert group.x is None and group.taken == 0  # all three took their slice: emptied
        assert same(f.v_proj(x), p.v_proj(x))  # alone
        x.mul_(2)  # an in-place write between members: a new input (eager mode checks the version counter)
        assert same(f.q_proj(x), p.q_proj(x))
        y = f.k_proj(x)
        assert same(y.view(1, 1, 2, 16).transpose(1, 2), p.k_proj(x).view(1, 1, 2, 16).transpose(1, 2))
    with torch.inference_mode():  # inference tensors have no version counter: identity alone
        xi = x + 1
        assert same(f.v_proj(xi), p.v_proj(xi)) and same(f.q_proj(xi), p.q_proj(xi))
        assert same(f.k_proj(xi), p.k_proj(xi)) and f.q_proj._fused.x is None


def test_compiled_forward_matches_and_does_not_recompile():
    from torch._inductor.compile_fx import compile_fx
    plain, fused = pair("int4")
    out = {}
    for name, model in (("plain", plain), ("fused", fused)):
        torch._dynamo.reset()
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return compile_fx(gm, example_inputs)

        compiled = torch.compile(model, backend=backend, dynamic=False)
        with torch.no_grad():
            out[name] = [compiled(input_ids=ids(1, seed=s), use_cache=False).logits for s in (1, 2)]
        assert len(graphs) == 1  # one graph, no graph break, no recompile on the second call
        gemvs = sum(n.op == "call_function" and "quant_gemv" in str(n.target) for n in graphs[0].graph.nodes)
        assert gemvs == (4 if name == "fused" else 7) * LAYERS
    assert all(g.x is None and g.taken == 0 for g in fused_groups(fused))
    for a, b, s in zip(out["plain"], out["fused"], (1, 2)):
        assert same(a, b)
        assert rel(b, logits(fused, ids(1, seed=s))) < 5e-3
    torch._dynamo.reset()


def test_replaced_tensors_dissolve_the_group():
    plain, fused = pair("int8")
    x = ids(3)
    ref = logits(plain, x)
    assert same(logits(fused, x), ref)
    groups = fused_groups(fused)
    fused.to(torch.float32)  # changes no QuantLinear buffer (codes are int, scales fp32 already): stays fused
    plain.to(torch.float32)
    assert fused_groups(fused) == groups
    ref32 = logits(plain, x)
    assert ref32.dtype == torch.float32 and same(logits(fused, x), ref32)
    fused._apply(lambda t: t.clone())  # what a move to another device does: every buffer a new tensor
    assert fused_groups(fused) == [] and all(not g.active and g.qw is None for g in groups)
    up, gate = fused.model.layers[0].mlp.up_proj, fused.model.layers[0].mlp.gate_proj
    assert up.qw.untyped_storage().data_ptr() != gate.qw.untyped_storage().data_ptr()
    assert same(logits(fused, x), ref32)
    assert fuse_projections(fused) == 2 * LAYERS
    assert same(logits(fused, x), ref32)
    fused.half()  # casts the fp32 scales: new tensors, the groups dissolve; the same as the unfused model's
    plain.half()
    assert fused_groups(fused) == [] and fused.model.layers[0].self_attn.q_proj.scales.dtype == torch.float16
    ref16 = logits(plain, x)
    assert same(logits(fused, x), ref16)
    assert fuse_projections(fused) == 2 * LAYERS
    assert same(logits(fused, x), ref16)
    up = fused.model.layers[1].mlp.up_proj  # assignment (also what load_state_dict(assign=True) does)
    up.qw = up.qw.clone()
    assert len(fused_groups(fused)) == 2 * LAYERS - 1 and up._fused is None
    assert same(logits(fused, x), ref16)


def test_load_state_dict_writes_through_the_views():
    _, fused = pair("int4")
    other = quantize(build("tiny-llama", seed=1).to(DEVICE), "int4", group_size=32, fuse=False)
    x = ids(2)
    fused.load_state_dict(other.state_dict())  # in place: copy_ into the views, i.e. into the fused tensors
    assert len(fused_groups(fused)) == 2 * LAYERS
    assert same(logits(fused, x), logits(other, x))
    clone = copy.deepcopy(fused)  # a deep copy is fused on its own tensors
    assert len(fused_groups(clone)) == 2 * LAYERS and fuse_projections(clone) == 0
    q = clone.model.layers[0].self_attn.q_proj
    assert q.qw.untyped_storage().data_ptr() == q._fused.qw.untyped_storage().data_ptr() != \
        fused.model.layers[0].self_attn.q_proj.qw.untyped_storage().data_ptr()
    assert same(logits(clone, x), logits(other, x))


def test_save_load_round_trip(tmp_path):
    plain, fused = pair("int4")
    save(fused, str(tmp_path / "fused"))
    save(plain, str(tmp_path / "plain"))
    tensors = {}
    for name in ("fused", "plain"):
        with safe_open(str(tmp_path / name / WEIGHTS), framework="pt") as f:
            tensors[name] = {k: f.get_tensor(k) for k in f.keys()}
    assert tensors["fused"].keys() == tensors["plain"].keys()
    assert all(torch.equal(tensors["fused"][k], tensors["plain"][k]) for k in tensors["plain"])
    x = ids(4)
    r = load(str(tmp_path / "fused"), device=DEVICE)
    assert len(fused_groups(r)) == 2 * LAYERS and fuse_projections(r) == 0
    assert torch.equal(logits(r, x), logits(fused, x))
    r_plain = load(str(tmp_path / "plain"), device=DEVICE)
    assert r_plain.automp_quant.fuse is False and fused_groups(r_plain) == [] and fuse_projections(r_plain) == 0
    meta_path = tmp_path / "plain" / META  # a file saved before the option existed: fused, the default
    meta = json.loads(meta_path.read_text())
    del meta["quant"]["fuse"]
    meta_path.write_text(json.dumps(meta))
    old = load(str(tmp_path / "plain"), device=DEVICE)
    assert old.automp_quant.fuse is True and len(fused_groups(old)) == 2 * LAYERS
    assert same(logits(old, x), logits(plain, x))


def test_generate_same_tokens_and_decoder_refuses():
    plain, fused = pair("int4")
    x = ids(4)
    ref = generate(plain, x, 3, mode="eager")
    assert fused_groups(plain) == []  # the decoder honours fuse=False
    assert torch.equal(generate(fused, x, 3, mode="eager"), ref)
    fused._apply(lambda t: t.clone())  # a moved model: unfused until a decoder is made
    assert fused_groups(fused) == []
    assert torch.equal(generate(fused, x, 3, mode="compile"), ref)  # the compiled decode step, fused
    dec = fused.__dict__[_ATTR]
    assert len(fused_groups(fused)) == 2 * LAYERS and dec.mode == "compile"
    assert _decoder(fused, 1, 7, "compile") is dec  # fingerprint taken after fusing: the decoder is reused
    torch._dynamo.reset()


def test_awq_groups_fuse_and_unfusable_groups_stay():
    model = build("tiny-llama").to(DEVICE)
    calib = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    kw = dict(group_size=32, calib=calib, awq=True)
    plain = quantize(copy.deepcopy(model), "int4", fuse=False, **kw)
    fused = quantize(copy.deepcopy(model), "int4", **kw)
    assert len(fused_groups(fused)) == 2 * LAYERS  # AWQ folded the groups' scales into the norms
    assert fused.model.layers[0].self_attn.o_proj.input_scale is not None  # GQA o_proj: explicit, and alone
    x = ids(3)
    assert same(logits(fused, x), logits(plain, x))
    odd = quantize(copy.deepcopy(model), "int8", group_size=32, fuse=False)
    layers = odd.model.layers
    layers[0].self_attn.k_proj.input_scale = torch.ones(64, dtype=torch.float16, device=DEVICE)
    layers[1].mlp.up_proj.bias = torch.zeros(128, dtype=torch.float16, device=DEVICE)  # gate has none
    odd.automp_quant = dataclasses.replace(odd.automp_quant, fuse=True)
    before = {k: v.data_ptr() for k, v in state(odd).items()}
    assert fuse_projections(odd) == 2 * LAYERS - 2
    assert layers[0].self_attn.q_proj._fused is None and layers[1].mlp.gate_proj._fused is None
    assert layers[0].mlp.gate_proj._fused is not None and layers[1].self_attn.q_proj._fused is not None
    assert before["model.layers.0.self_attn.k_proj.qw"] == state(odd)["model.layers.0.self_attn.k_proj.qw"].data_ptr()


def test_gpt2_has_nothing_to_fuse():
    q = quantize(build("tiny-gpt2").to(DEVICE), "int8", group_size=32)
    before = {k: v.data_ptr() for k, v in state(q).items()}
    assert fuse_projections(q) == 0 and fused_groups(q) == []
    assert {k: v.data_ptr() for k, v in state(q).items()} == before
    assert fuse_projections(build("tiny-llama")) == 0  # not quantized: nothing


def test_cli_no_fuse(tmp_path, capsys):
    out = str(tmp_path / "q")
    assert cli.main(["quantize", "--model", "tiny-llama", "--bits", "8", "--group-size", "32", "--device", "cpu",
                     "--no-fuse", "-o", out]) == 0
    capsys.readouterr()
    with open(os.path.join(out, META)) as f:
        assert json.load(f)["quant"]["fuse"] is False
    r = load(out)
    assert r.automp_quant.fuse is False and fused_groups(r) == []
    assert all(m._fused is None for m in r.modules() if isinstance(m, QuantLinear))
