import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from automp.deploy import runtime
from automp.deploy.cli import main

from .util import f32, init, model, rand


def _convnet():
    rng = np.random.default_rng(0)
    bn = [init("g", rng.uniform(0.5, 1.5, 8).astype(np.float32)), init("be", rand(8, seed=7, scale=0.1)),
          init("mu", rand(8, seed=8, scale=0.1)), init("var", rng.uniform(0.5, 2, 8).astype(np.float32))]
    nodes = [helper.make_node("Conv", ["image", "w1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("BatchNormalization", ["c1", "g", "be", "mu", "var"], ["b1"], name="bn1"),
             helper.make_node("Relu", ["b1"], ["r1"], name="relu1"),
             helper.make_node("GlobalAveragePool", ["r1"], ["gap"], name="gap"),
             helper.make_node("Flatten", ["gap"], ["flat"], name="flat"),
             helper.make_node("MatMul", ["flat", "wf"], ["mm"], name="fc"),
             helper.make_node("Add", ["mm", "bf"], ["logits"], name="fc_bias")]
    inits = [init("w1", rand(8, 3, 3, 3, seed=1, scale=0.3)), init("wf", rand(8, 5, seed=2, scale=0.5)),
             init("bf", rand(5, seed=3, scale=0.1))] + bn
    return model(nodes, [f32("image", ["n", 3, 8, 8])], [f32("logits", ["n", 5])], inits, opset=17)


@pytest.fixture
def files(tmp_path):
    src = tmp_path / "net.onnx"
    onnx.save(_convnet(), src)
    calib = tmp_path / "calib.npz"
    np.savez(calib, image=rand(64, 3, 8, 8, seed=11))
    return src, calib, tmp_path


def _io(m):
    return [(v.name, v.type.tensor_type.elem_type) for v in list(m.graph.input) + list(m.graph.output)]


@pytest.mark.parametrize("precision,tol", [("fp32", 1e-5), ("fp16", 1e-2)])
def test_optimize_writes_model_and_report(files, precision, tol, capsys):
    src, calib, tmp = files
    out, rep_path = tmp / f"out_{precision}.onnx", tmp / f"rep_{precision}.json"
    rc = main([str(src), "-o", str(out), "--precision", precision, "--calib", str(calib), "--report", str(rep_path)])
    assert rc == 0
    before, after = onnx.load(src), onnx.load(out)
    assert _io(after) == _io(before) == [("image", TensorProto.FLOAT), ("logits", TensorProto.FLOAT)]
    rep = json.loads(rep_path.read_text())
    passes = {p["name"]: p for p in rep["passes"]}
    assert passes["fold_bn"]["nodes_after"] < passes["fold_bn"]["nodes_before"]
    assert "BatchNormalization" not in [n.op_type for n in after.graph.node]
    assert rep["error_vs_fp32"]["logits"]["rel_l2"] <= tol and rep["error_data"].startswith("calibration")
    # the report's error is real: recompute it independently in onnxruntime CPU
    x = {"image": np.load(calib)["image"]}
    e = runtime.compare(runtime.run(after, x)["logits"], runtime.run(before, x)["logits"])
    assert e.rel_l2 == pytest.approx(rep["error_vs_fp32"]["logits"]["rel_l2"], rel=1e-3, abs=1e-7)
    assert "fold_bn" in capsys.readouterr().out
    if precision == "fp16":
        assert rep["fp16_nodes"] >= 3
        assert any(t.data_type == TensorProto.FLOAT16 for t in after.graph.initializer)


def test_int8_without_calib_is_a_clear_error(files, capsys):
    src, _, tmp = files
    assert main([str(src), "-o", str(tmp / "q.onnx"), "--precision", "int8"]) == 1
    err = capsys.readouterr().err
    assert "--calib" in err and "image" in err
    assert not (tmp / "q.onnx").exists()


def test_int8_with_calib_quantizes_layers(files):
    pytest.importorskip("automp.compress.quant.ptq")
    src, calib, tmp = files
    out, rep_path = tmp / "q.onnx", tmp / "q.json"
    assert main([str(src), "-o", str(out), "--precision", "int8", "--calib", str(calib),
                 "--report", str(rep_path)]) == 0
    rep = json.loads(rep_path.read_text())
    assert rep["layers_quantized"]
    assert 0 < rep["error_vs_fp32"]["logits"]["rel_l2"] < 0.1
    assert _io(onnx.load(out)) == _io(onnx.load(src))


def test_corrupt_file_and_bad_calib_name_the_problem(files, capsys):
    src, calib, tmp = files
    bad = tmp / "broken.onnx"
    bad.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    assert main([str(bad), "-o", str(tmp / "o.onnx")]) == 1
    assert "broken.onnx" in capsys.readouterr().err
    wrong = tmp / "wrong.npz"
    np.savez(wrong, pixels=rand(4, 3, 8, 8))
    assert main([str(src), "-o", str(tmp / "o.onnx"), "--calib", str(wrong)]) == 1
    err = capsys.readouterr().err
    assert "'image'" in err and "'pixels'" in err


def test_unsupported_op_is_named(tmp_path, capsys):
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="ok"),
             helper.make_node("Frobnicate", ["r"], ["y"], name="weird_node", domain="acme.ops")]
    m = helper.make_model(helper.make_graph(nodes, "g", [f32("x", [2])], [f32("y", [2])]),
                          opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("acme.ops", 1)])
    path = tmp_path / "custom.onnx"
    onnx.save(m, path)
    assert main([str(path), "-o", str(tmp_path / "o.onnx")]) == 1
    err = capsys.readouterr().err
    assert "weird_node" in err and "Frobnicate" in err and "custom.onnx" in err


def test_budget_miss_is_an_error_and_writes_nothing(files, capsys):
    src, calib, tmp = files
    out = tmp / "tight.onnx"
    assert main([str(src), "-o", str(out), "--precision", "fp16", "--calib", str(calib), "--budget", "1e-9"]) == 1
    assert "exceeds budget" in capsys.readouterr().err and not out.exists()
