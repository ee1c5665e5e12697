"""Which kernel a weight-only layer's projection calls at each row count, with the kernels forced on the CPU (Triton
interpreter) and automp.kernels.crossover's clock replaced by a fake one (no real timing)."""
import pytest
import torch

import automp.quant.weight_only as weight_only
from automp.kernels import crossover
from automp.quant.weight_only import WeightOnlyLinear


class FakeClock:
    """timer(label, fn) -> the table's milliseconds for label, without running fn (the interpreter is slow)."""

    def __init__(self, **ms: float):
        self.ms = ms
        self.calls: list[str] = []

    def __call__(self, label, fn):
        self.calls.append(label)
        return self.ms[label]


@pytest.fixture
def layer(monkeypatch):
    monkeypatch.setattr(weight_only, "FORCE_KERNELS", True)
    crossover.reset()
    gen = torch.Generator().manual_seed(0)
    yield WeightOnlyLinear.from_weight(torch.randn(24, 64, generator=gen), torch.randn(24, generator=gen), 4, 32)
    crossover.reset()


def _ops_called(fn) -> list[str]:
    """The automp ops in the graph Dynamo traces from fn (fullgraph: the choice must not break the graph)."""
    seen: list[str] = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "automp" in str(n.target))
        return gm.forward
    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)()
    return seen


def _x(rows: int) -> torch.Tensor:
    return torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).half()


@pytest.mark.parametrize("rows_ms,gemm_ms,op", [(1.0, 2.0, "automp.quant_gemv_rows"), (2.0, 1.0, "automp.quant_gemm")])
def test_small_batch_uses_the_measured_faster_kernel(monkeypatch, layer, rows_ms, gemm_ms, op):
    clock = FakeClock(rows=rows_ms, gemm=gemm_ms)
    monkeypatch.setattr(crossover, "TIMER", clock)
    x = _x(4)
    y = layer(x)  # eager: measures, then computes with the winner
    ref = x.double() @ layer.dequantized().double().T + layer.bias.double()
    assert float((y.double() - ref).norm() / ref.norm()) < 2e-3
    assert clock.calls == ["rows", "gemm"]
    assert _ops_called(lambda: layer(x)) == [op]
    assert clock.calls == ["rows", "gemm"]  # tracing reuses the decision


def test_planes_kernel_serves_where_it_is_measured_fastest(monkeypatch):
    """Groups of 128 and K a whole number of words: the planes kernel competes too, up to 64 rows."""
    monkeypatch.setattr(weight_only, "FORCE_KERNELS", True)
    crossover.reset()
    gen = torch.Generator().manual_seed(1)
    wide = WeightOnlyLinear.from_weight(torch.randn(24, 256, generator=gen), None, 4, 128)
    clock = FakeClock(rows=2.0, planes=1.0, gemm=3.0)
    monkeypatch.setattr(crossover, "TIMER", clock)
    try:
        for rows, timed in ((4, ["rows", "planes", "gemm"]), (40, ["planes", "gemm"])):
            x = torch.randn(rows, 256, generator=gen).half()
            y = wide(x)
            ref = x.double() @ wide.dequantized().double().T
            assert float((y.double() - ref).norm() / ref.norm()) < 2e-3
            assert clock.calls == timed
            clock.calls.clear()
            assert _ops_called(lambda: wide(x)) == ["automp.quant_planes"]
    finally:
        crossover.reset()


def test_one_row_and_many_rows_are_not_measured(monkeypatch, layer):
    clock = FakeClock(rows=1.0, gemm=2.0)
    monkeypatch.setattr(crossover, "TIMER", clock)
    one, many = _x(1), _x(crossover.MAX_ROWS + 1)
    assert _ops_called(lambda: layer(one)) == ["automp.quant_gemv"]
    assert _ops_called(lambda: layer(many)) == ["automp.quant_gemm"]
    assert clock.calls == [] and crossover.decisions() == {}


def test_tracing_before_any_decision_uses_the_gemm_and_records_nothing(monkeypatch, layer):
    clock = FakeClock(rows=1.0, gemm=2.0)
    monkeypatch.setattr(crossover, "TIMER", clock)
    x = _x(3)
    assert _ops_called(lambda: layer(x)) == ["automp.quant_gemm"]
    assert clock.calls == [] and crossover.decisions() == {}
