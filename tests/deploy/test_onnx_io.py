import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

from automp.deploy import onnx_io, runtime
from automp.quant.ptq.compare import compare

from .util import f32, init, model, rand


def _small():
    return model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [f32("x", ["n", 3])],
                 [f32("y", ["n", 2])], [init("w", rand(3, 2))])


def test_save_load_roundtrip_from_path_and_bytes(tmp_path):
    m = _small()
    path = tmp_path / "m.onnx"
    onnx_io.save(m, path)
    assert onnx_io.load(path) == m
    assert onnx_io.load(path.read_bytes()) == m


@pytest.mark.parametrize("opset,ir", [(13, 7), (17, 8), (17, 9), (17, 10)])
def test_save_keeps_the_ir_version(tmp_path, opset, ir):
    m = model([helper.make_node("Relu", ["x"], ["y"])], [f32("x", ["n", 3])], [f32("y", ["n", 3])], opset=opset)
    m.ir_version = ir
    onnx_io.save(m, tmp_path / "m.onnx")
    assert onnx_io.load(tmp_path / "m.onnx").ir_version == ir


def test_missing_truncated_and_garbage_files_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.onnx"):
        onnx_io.load(tmp_path / "nope.onnx")
    path = tmp_path / "cut.onnx"
    data = _small().SerializeToString()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cut\.onnx: not a readable ONNX file"):
        onnx_io.load(path)
    with pytest.raises(ValueError, match="<bytes>"):
        onnx_io.load(np.random.default_rng(0).bytes(300))


def test_invalid_graph_is_reported_by_the_checker():
    m = _small()
    m.graph.node[0].input[0] = "undefined_tensor"
    with pytest.raises(ValueError, match="undefined_tensor"):
        onnx_io.validate(m, "bad.onnx")


def test_unknown_onnx_op_and_unsupported_type_name_node_and_op():
    m = _small()
    m.graph.node[0].op_type = "MatMulTwice"
    with pytest.raises(onnx_io.UnsupportedOpError, match=r"'mm' \(op MatMulTwice\)"):
        onnx_io.validate(m, "x.onnx")
    int8 = helper.make_tensor_value_info
    m2 = model([helper.make_node("Erf", ["x"], ["y"], name="erf_i8")], [int8("x", TensorProto.INT8, [2])],
               [int8("y", TensorProto.INT8, [2])])
    with pytest.raises(NotImplementedError, match=r"erf_i8.*Erf"):
        onnx_io.validate(m2, "i8.onnx")


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, img, scale):
        h = torch.relu(self.bn(self.conv(img))).mean((2, 3))
        return self.fc(h) * scale, h


@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
def test_export_torch_names_io_and_keeps_batch_dynamic(exporter):
    torch.manual_seed(0)
    net = _Net()
    with torch.no_grad():
        net.bn.running_mean.normal_()
        net.bn.running_var.uniform_(0.5, 2)
    ex = (torch.randn(2, 3, 6, 6), torch.randn(2, 1))
    m = onnx_io.export_torch(net, ex, ["img", "scale"], ["logits", "feat"], exporter=exporter)
    assert [i.name for i in m.graph.input] == ["img", "scale"]
    assert [o.name for o in m.graph.output] == ["logits", "feat"]
    assert not m.graph.input[0].type.tensor_type.shape.dim[0].HasField("dim_value")  # symbolic batch
    x = (torch.randn(5, 3, 6, 6), torch.randn(5, 1))  # another batch size than the example
    outs = runtime.run(m, {"img": x[0].numpy(), "scale": x[1].numpy()})
    with torch.no_grad():
        ref = net(*x)
    for name, r in zip(["logits", "feat"], ref):
        assert compare(outs[name], r.numpy()).rel_l2 < 1e-5


@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
def test_export_uses_the_lowest_ir_version_for_its_opsets(exporter):
    """onnx >= 1.23 and the exporters stamp newer IR versions than the opsets need (onnxruntime 1.30 loads at most
    IR 13); an exported model carries the lowest IR version its opsets allow."""
    m = onnx_io.export_torch(_Net(), (torch.randn(2, 3, 6, 6), torch.randn(2, 1)), exporter=exporter)
    assert m.ir_version == helper.find_min_ir_version_for(m.opset_import, ignore_unknown=True) <= 10


def test_export_rejects_bad_options():
    with pytest.raises(ValueError, match="exporter"):
        onnx_io.export_torch(_Net(), (torch.randn(1, 3, 4, 4), torch.randn(1, 1)), exporter="magic")
    with pytest.raises(ValueError, match="opset"):
        onnx_io.export_torch(_Net(), (torch.randn(1, 3, 4, 4), torch.randn(1, 1)), opset=13)
