import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from automp.deploy import onnx_io, runtime
from automp.deploy.cli import main
from automp.quant.ptq.compare import compare

from .util import f32, rand


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
    e = compare(runtime.run(after, x)["logits"], runtime.run(before, x)["logits"])
    assert e.rel_l2 == pytest.approx(rep["error_vs_fp32"]["logits"]["rel_l2"], rel=1e-3, abs=1e-7)
    assert "fold_bn" in capsys.readouterr().out
    if precision == "fp16":
        assert rep["fp16_nodes"] >= 3
        assert any(t.data_type == TensorProto.FLOAT16 for t in after.graph.initializer)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_output_keeps_the_input_ir_version(files, precision):
    src, calib, tmp = files
    m = onnx.load(src)
    m.ir_version = 9  # above the lowest that opset 17 allows (8): kept, not lowered or raised to onnx's newest
    onnx.save(m, src)
    out = tmp / "out.onnx"
    assert main([str(src), "-o", str(out), "--precision", precision, "--calib", str(calib)]) == 0
    assert onnx.load(out).ir_version == 9


def test_int8_without_calib_is_a_clear_error(files, capsys):
    src, _, tmp = files
    assert main([str(src), "-o", str(tmp / "q.onnx"), "--precision", "int8"]) == 1
    err = capsys.readouterr().err
    assert "--calib" in err and "image" in err
    assert not (tmp / "q.onnx").exists()


def test_int8_with_calib_quantizes_layers(files):
    pytest.importorskip("automp.deploy.qdq.ptq")
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
    m = onnx_io.fit_ir_version(helper.make_model(helper.make_graph(nodes, "g", [f32("x", [2])], [f32("y", [2])]),
                               opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("acme.ops", 1)]))
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


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_calibration_data_is_an_error(files, capsys, precision, bad):
    src, calib, tmp = files
    images = np.load(calib)["image"]
    images[3, 1, 2, 2] = bad
    np.savez(calib, image=images)
    out = tmp / "o.onnx"
    assert main([str(src), "-o", str(out), "--precision", precision, "--calib", str(calib)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(calib) in err and "'image'" in err and "non-finite" in err
    assert not out.exists()


def test_an_empty_calibration_batch_is_named(files, capsys):
    src, calib, tmp = files
    np.savez(calib, image=np.zeros((0, 3, 8, 8), np.float32))
    assert main([str(src), "-o", str(tmp / "o.onnx"), "--precision", "fp16", "--calib", str(calib)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'image'" in err and "empty batch" in err and "onnxruntime" not in err.lower()


def test_every_option_has_help():
    from automp.deploy.cli import build_parser
    assert [a.dest for a in build_parser()._actions if not (a.help or "").strip()] == []


@pytest.mark.parametrize("cut", ["half", "one_byte_short"])
def test_a_truncated_calibration_file_is_named_in_one_line(files, capsys, cut):
    src, calib, tmp = files
    np.savez(calib, image=np.random.default_rng().standard_normal((16, 3, 8, 8)).astype(np.float32))
    data = calib.read_bytes()
    calib.write_bytes(data[: len(data) // 2] if cut == "half" else data[:-1])
    out = tmp / "o.onnx"
    assert main([str(src), "-o", str(out), "--calib", str(calib)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("automp optimize: error:") and "Traceback" not in err
    assert str(calib) in err and "truncated or corrupt" in err
    assert not out.exists()
