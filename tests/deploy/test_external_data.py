"""No output of `automp optimize` may be, or be written over, a file the input model reads: the model itself and
every external-data file it references (paths relative to the model's folder)."""
import os

import numpy as np
import onnx
import pytest
from onnx import helper

from automp.deploy import onnx_io, runtime
from automp.deploy.cli import main
from automp.quant.ptq.compare import compare

from .util import convnet, f32, init, model


def _external(tmp_path, name="net.onnx", location="net.onnx.data"):
    """The conv net saved with every weight in `location`; returns (model path, data path)."""
    src = tmp_path / name
    (tmp_path / location).parent.mkdir(parents=True, exist_ok=True)
    onnx.save(convnet(), src, save_as_external_data=True, location=location, size_threshold=0)
    data = tmp_path / location
    assert data.stat().st_size > 0 and onnx.load(src, load_external_data=False).graph.initializer[0].external_data
    return src, data


def _outputs(src, seed):
    feeds = runtime.random_feeds(onnx.load(src), batch=3, seed=seed)
    return runtime.run(onnx.load(src), feeds)["logits"]


def test_external_data_files_are_resolved_in_the_models_folder(tmp_path):
    src, data = _external(tmp_path, location="sub/w.bin")
    assert [os.path.realpath(f) for f in onnx_io.external_data_files(src)] == [os.path.realpath(data)]
    files = onnx_io.input_files(src)
    assert sorted(map(os.path.realpath, files.values())) == sorted(map(os.path.realpath, (src, data)))
    inline = tmp_path / "inline.onnx"
    onnx.save(convnet(), inline)
    assert onnx_io.external_data_files(inline) == []


@pytest.mark.parametrize("location", ["net.onnx.data", "weights.bin", "sub/w.bin"])
@pytest.mark.parametrize("flag", ["-o", "--report"])
def test_optimize_refuses_to_write_over_the_inputs_external_data(tmp_path, capsys, location, flag):
    src, data = _external(tmp_path, location=location)
    seed = int(np.random.default_rng().integers(1 << 30))
    ref, before = _outputs(src, seed), data.read_bytes()
    spelled = str(tmp_path / "sub" / ".." / location)  # another spelling of the same file
    (tmp_path / "sub").mkdir(exist_ok=True)
    argv = [str(src), "-o", spelled] if flag == "-o" else [str(src), "-o", str(tmp_path / "o.onnx"), flag, spelled]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "external data" in err and "refusing to overwrite" in err and flag in err
    assert data.read_bytes() == before and not (tmp_path / "o.onnx").exists()
    np.testing.assert_array_equal(_outputs(src, seed), ref)  # the input still computes what it did


def test_optimize_refuses_an_output_whose_own_data_file_is_the_inputs(tmp_path, capsys):
    """A model past protobuf's limit is written as OUT plus OUT.data; that side file must not be an input's either
    (it is not known before the work whether the optimized model will need it)."""
    src, data = _external(tmp_path, name="a.onnx", location="b.onnx.data")
    before = data.read_bytes()
    assert main([str(src), "-o", str(tmp_path / "b.onnx")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "b.onnx.data" in err and "external data" in err
    assert data.read_bytes() == before and not (tmp_path / "b.onnx").exists()


def test_optimize_of_a_model_with_external_data_writes_elsewhere(tmp_path):
    src, data = _external(tmp_path)
    before = data.read_bytes()
    out = tmp_path / "out" / "o.onnx"
    out.parent.mkdir()
    assert main([str(src), "-o", str(out)]) == 0
    seed = int(np.random.default_rng().integers(1 << 30))
    feeds = runtime.random_feeds(onnx.load(src), batch=2, seed=seed)
    got, ref = runtime.run(onnx.load(out), feeds)["logits"], runtime.run(onnx.load(src), feeds)["logits"]
    assert compare(got, ref).rel_l2 < 1e-5 and data.read_bytes() == before


def test_save_refuses_to_write_over_a_kept_file(tmp_path, monkeypatch):
    """onnx_io.save(keep=...) is the last line: neither the model file nor the side file it writes for a big model
    (forced here by a zero threshold) may be a kept file; nothing is written."""
    src, data = _external(tmp_path, name="a.onnx", location="b.onnx.data")
    keep = list(onnx_io.input_files(src).values())
    before = data.read_bytes()
    m = onnx.load(src)
    with pytest.raises(ValueError, match="refusing to overwrite"):
        onnx_io.save(m, data, keep=keep)
    onnx_io.save(m, tmp_path / "b.onnx", keep=keep)  # small: one self-contained file, b.onnx.data untouched
    assert data.read_bytes() == before
    monkeypatch.setattr(onnx_io, "EXTERNAL_DATA_BYTES", 0)
    (tmp_path / "b.onnx").unlink()
    with pytest.raises(ValueError, match=r"b\.onnx\.data"):
        onnx_io.save(m, tmp_path / "b.onnx", keep=keep)
    assert data.read_bytes() == before and not (tmp_path / "b.onnx").exists()
    w = np.random.default_rng().standard_normal((64, 64)).astype(np.float32)  # past onnx's 1 KiB inline limit
    m = model([helper.make_node("MatMul", ["x", "w"], ["y"])], [f32("x", ["n", 64])], [f32("y", ["n", 64])],
              [init("w", w)])
    before = m.SerializeToString()
    onnx_io.save(m, tmp_path / "c.onnx", keep=keep)  # big and elsewhere: model plus its own side file
    assert m.SerializeToString() == before  # the caller's model keeps its weights (onnx's writer moves them out)
    assert onnx_io.external_data_files(tmp_path / "c.onnx") == [str(tmp_path / "c.onnx.data")]
    got = {t.name: onnx.numpy_helper.to_array(t) for t in onnx_io.load(tmp_path / "c.onnx").graph.initializer}
    want = {t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer}
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
