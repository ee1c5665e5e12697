"""torch.compile sees the converted model as one graph with the automp kernels as opaque custom-op nodes.

On the CPU: Dynamo's explain and a counting backend (no Inductor), and aot_eager, which runs every custom op's fake
impl through AOTAutograd - what Inductor + CUDA graphs rely on, without a GPU.
"""
import pytest
import torch

from automp.deploy.quantized import TorchQuantConfig, compile_module, graph_breaks, quantize_module

from tests.quant.torch_helpers import DEVICE, bert_batch, randn, rel_err, tiny_bert

EAGER = TorchQuantConfig(compile=False)


@pytest.fixture
def kernel_ops(monkeypatch):
    """Weight-only layers call the kernel ops on the CPU too (their CPU default is a torch reference with no op)."""
    import automp.quant.weight_only as weight_only
    monkeypatch.setattr(weight_only, "FORCE_KERNELS", True)


def _automp_ops(model, *args, **kwargs) -> list[str]:
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "automp" in str(n.target))
        return gm.forward
    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True, dynamic=False)(*args, **kwargs)
    return seen


@pytest.mark.parametrize("precision,op", [("int8", "automp.int8_gemm"), ("int4-weight", "automp.quant_gemm")])
def test_converted_bert_traces_as_one_graph(precision, op, kernel_ops):
    bert = tiny_bert(layers=1, pooler=False)
    model, rep = quantize_module(bert, precision, None, EAGER)
    batch = bert_batch(2, 5, seed=1)
    breaks, reasons = graph_breaks(model, **batch)
    assert breaks == 0, reasons
    assert _automp_ops(model, **batch) == [op] * len(rep.layers) == [op] * 6


def test_one_token_uses_the_gemv_op(kernel_ops):
    net = torch.nn.Linear(64, 24).to(DEVICE)
    model, _ = quantize_module(net, "int8-weight", None, EAGER)
    assert _automp_ops(model, randn(1, 64, seed=2).to(DEVICE)) == ["automp.quant_gemv"]


def test_aot_eager_matches_eager():
    bert = tiny_bert(layers=1)
    model, _ = quantize_module(bert, "int8", None, EAGER)
    batch = bert_batch(2, 5, seed=3)
    eager = model(**batch)
    torch._dynamo.reset()
    compiled = compile_module(model, backend="aot_eager")
    got = compiled(**batch)
    assert got.last_hidden_state.dtype == torch.float32
    assert rel_err(got.last_hidden_state, eager.last_hidden_state) < 1e-3


def test_compile_module_on_cpu_is_eager_and_checks_mode():
    net = torch.nn.Linear(8, 8)
    assert compile_module(net) is net  # no CUDA graphs on the CPU
    with pytest.raises(ValueError, match="compile mode"):
        compile_module(net, mode="fast")


@pytest.mark.parametrize("mode,cudagraphs", [("reduce-overhead", True), ("default", False),
                                             ("max-autotune-no-cudagraphs", False)])
def test_inductor_options_keep_the_mode_and_add_the_requant_pass(mode, cudagraphs):
    from automp.deploy.quantized.compile import inductor_options
    from automp.deploy.quantized.requant import RequantPass
    opts = inductor_options(mode)
    assert isinstance(opts["post_grad_custom_post_pass"], RequantPass)
    assert "triton.multi_kernel" not in opts  # fails on a warm Inductor cache with torch 2.11 (module docstring)
    assert opts.get("triton.cudagraphs", False) is cudagraphs
    assert opts.get("max_autotune", False) is mode.startswith("max-autotune")
    with torch._inductor.config.patch(opts):  # every key is a real Inductor setting (an unknown one raises)
        assert isinstance(torch._inductor.config.post_grad_custom_post_pass, RequantPass)


def test_inductor_options_name_real_settings():
    with pytest.raises((AttributeError, KeyError, RuntimeError)):
        with torch._inductor.config.patch({"triton.no_such_setting": 1}):
            pass


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_cuda_graphs_replay_the_int8_model():
    bert = tiny_bert(layers=1)
    batch = bert_batch(2, 8, seed=4)
    model, _ = quantize_module(bert, "int8", None, TorchQuantConfig())
    eager, _ = quantize_module(bert, "int8", None, EAGER)
    ref = eager(**batch).last_hidden_state
    for _ in range(3):  # compile, record, replay
        out = model(**batch).last_hidden_state.clone()
    assert rel_err(out, ref) < 1e-3
