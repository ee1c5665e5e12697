import onnx
import pytest
import torch
from torch import nn

import automp.deploy.qdq.export as export_mod
from automp.deploy.qdq.export import export_float, export_qat_onnx
from automp.quant.qat import convert_qat, prepare_qat
from tests.quant.helpers import ort_run, rel_err


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).eval()


def test_export_falls_back_to_torchscript_exporter(monkeypatch):
    real = torch.onnx.export
    calls = []

    def no_dynamo(*args, dynamo=True, **kw):
        calls.append(dynamo)
        if dynamo:
            raise RuntimeError("simulated dynamo exporter failure")
        return real(*args, dynamo=False, **kw)

    monkeypatch.setattr(torch.onnx, "export", no_dynamo)
    model, x = _mlp(), torch.randn(5, 6)
    proto = export_float(model, (x[:2],), ["x"], ["y"])
    assert calls == [True, False]
    with torch.no_grad():
        assert rel_err(ort_run(proto, {"x": x.numpy()})[0], model(x).numpy()) < 1e-6  # dynamic batch works


def test_export_reports_both_failures(monkeypatch):
    def broken(*args, dynamo=True, **kw):
        raise RuntimeError(f"boom dynamo={dynamo}")

    monkeypatch.setattr(torch.onnx, "export", broken)
    with pytest.raises(RuntimeError, match="(?s)both exporters.*boom dynamo=True.*boom dynamo=False"):
        export_float(_mlp(), (torch.randn(2, 6),))


def test_qat_export_matches_layers_by_weight_value_when_names_change(monkeypatch):
    """Exporters may rename initializers; the QAT writer then finds each layer by its weight values."""
    model = prepare_qat(_mlp())
    x = torch.randn(32, 6)
    model(x)
    convert_qat(model)
    real = export_mod.export_float

    def renamed(*args, **kw):
        proto = real(*args, **kw)
        for init in proto.graph.initializer:
            old, init.name = init.name, f"param_{abs(hash(init.name)) % 10000}"
            for node in proto.graph.node:
                node.input[:] = [init.name if i == old else i for i in node.input]
        return proto

    monkeypatch.setattr(export_mod, "export_float", renamed)
    proto = export_qat_onnx(model, (x[:2],), ["x"], ["y"])
    int8_weights = [i for i in proto.graph.initializer if i.data_type == onnx.TensorProto.INT8 and len(i.dims) == 2]
    assert sorted(tuple(i.dims) for i in int8_weights) == [(3, 8), (8, 6)]
    with torch.no_grad():
        ref = model(x).numpy()
    assert rel_err(ort_run(proto, {"x": x.numpy()})[0], ref) < 1e-2


@pytest.mark.parametrize("use_dynamo", [True, False])
def test_export_uses_the_lowest_ir_version_for_its_opsets(monkeypatch, use_dynamo):
    """onnx >= 1.23 and the exporters stamp newer IR versions than the opsets need; onnxruntime <= 1.30 refuses
    IR 14. The exported model carries the lowest IR version its opsets allow, whichever exporter made it."""
    real = torch.onnx.export

    def only_one(*args, dynamo=True, **kw):
        if dynamo != use_dynamo:
            raise RuntimeError("the other exporter")
        return real(*args, dynamo=dynamo, **kw)

    monkeypatch.setattr(torch.onnx, "export", only_one)
    proto = export_float(_mlp(), (torch.randn(2, 6),), ["x"], ["y"])
    assert proto.ir_version == onnx.helper.find_min_ir_version_for(proto.opset_import, ignore_unknown=True) <= 10
