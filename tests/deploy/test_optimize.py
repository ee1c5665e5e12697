import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

from automp.deploy import check_calib, optimize, runtime
from automp.quant.ptq.compare import compare

from .util import f32, init, model, rand


class _ConvBN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).amax((2, 3)))


def test_optimize_a_torch_module_to_fp16():
    torch.manual_seed(0)
    net = _ConvBN().eval()
    with torch.no_grad():
        net.bn.running_mean.normal_()
        net.bn.running_var.uniform_(0.5, 2.0)
    out, rep = optimize(net, precision="fp16", example_inputs=(torch.randn(2, 3, 8, 8),), input_names=["image"],
                        output_names=["logits"])
    assert [i.name for i in out.graph.input] == ["image"] and [o.name for o in out.graph.output] == ["logits"]
    assert out.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    x = torch.randn(6, 3, 8, 8)
    with torch.no_grad():
        ref = net(x).numpy()
    e = compare(runtime.run(out, {"image": x.numpy()})["logits"], ref)
    assert 0 < e.rel_l2 < 1e-2
    assert "Conv" in [n.op_type for n in out.graph.node] and rep["fp16_nodes"] >= 3


def test_check_calib_rejects_mismatched_data():
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["n", 5])
    m = model([helper.make_node("Gather", ["table", "ids"], ["e"]), helper.make_node("Add", ["e", "x"], ["y"])],
              [ids, f32("x", ["n", 5, 3])], [f32("y", ["n", 5, 3])], [init("table", rand(9, 3))])
    good = {"ids": np.zeros((4, 5), np.int32), "x": rand(4, 5, 3).astype(np.float64)}
    checked = check_calib(m, good)
    assert checked["ids"].dtype == np.int64 and checked["x"].dtype == np.float32
    with pytest.raises(ValueError, match="rank"):
        check_calib(m, {**good, "x": rand(4, 15)})
    with pytest.raises(TypeError, match="'ids' is float32"):
        check_calib(m, {**good, "ids": rand(4, 5)})
    with pytest.raises(ValueError, match="batch size"):
        check_calib(m, {**good, "x": rand(3, 5, 3)})
    with pytest.raises(ValueError, match=r"missing \['x'\]"):
        check_calib(m, {"ids": good["ids"]})


def test_bad_precision_and_budget_are_rejected():
    m = model([helper.make_node("Relu", ["x"], ["y"])], [f32("x", [2])], [f32("y", [2])])
    with pytest.raises(ValueError, match="precision"):
        optimize(m, precision="int4")
    with pytest.raises(ValueError, match="budget"):
        optimize(m, budget=-1.0)
