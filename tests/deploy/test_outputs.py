"""Output files of `automp optimize`: written atomically, checked before any work, never one of the inputs."""
import errno
import json
import os

import onnx
import pytest

import automp.deploy
from automp.deploy import onnx_io, report
from automp.deploy.cli import main
from automp.files import atomic_output

from .util import convnet


def _disk_full(path):
    """Write the first bytes of a file, then fail as a full disk does."""
    with open(path, "wb") as f:
        f.write(b"\x08\x01partial")
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _json_disk_full(obj, f, **kwargs):
    f.write('{"trunc')
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _leftovers(folder) -> list[str]:
    return sorted(f for f in os.listdir(folder) if f.startswith("."))


def test_failed_model_write_keeps_the_existing_file(tmp_path, monkeypatch):
    path = tmp_path / "net.onnx"
    onnx.save(convnet(), path)
    before = path.read_bytes()
    monkeypatch.setattr(onnx, "save_model", lambda model, f, **kw: _disk_full(f))
    with pytest.raises(OSError, match="No space left"):
        onnx_io.save(convnet(batch=2), path)
    assert path.read_bytes() == before and _leftovers(tmp_path) == []


def test_failed_report_write_keeps_the_existing_report(tmp_path, monkeypatch):
    path = tmp_path / "rep.json"
    path.write_text('{"old": 1}')
    monkeypatch.setattr(json, "dump", _json_disk_full)
    with pytest.raises(OSError, match="No space left"):
        report.write({"new": 2}, path)
    assert path.read_text() == '{"old": 1}' and _leftovers(tmp_path) == []


def test_cli_write_failure_leaves_the_previous_output(files, monkeypatch, capsys):
    src, _, tmp = files
    out = tmp / "out.onnx"
    assert main([str(src), "-o", str(out)]) == 0
    before = out.read_bytes()
    monkeypatch.setattr(onnx, "save_model", lambda model, f, **kw: _disk_full(f))
    assert main([str(src), "-o", str(out), "--precision", "fp16"]) == 1
    err = capsys.readouterr().err
    assert "No space left" in err and len(err.strip().splitlines()) == 1
    assert out.read_bytes() == before and _leftovers(tmp) == []


def test_a_successful_write_replaces_the_file_and_keeps_its_mode(tmp_path):
    path = tmp_path / "net.onnx"
    path.write_bytes(b"old")
    path.chmod(0o640)
    onnx_io.save(convnet(), path)
    assert onnx.load(path) == convnet() and (path.stat().st_mode & 0o777) == 0o640 and _leftovers(tmp_path) == []


def test_side_files_are_moved_with_the_file(tmp_path):
    """ONNX external data is written beside the model, under the model's name: both land, or neither."""
    with atomic_output(tmp_path / "m.onnx") as tmp:
        assert os.path.basename(tmp) == "m.onnx" and os.path.dirname(tmp) != str(tmp_path)
        for name, data in (("m.onnx", b"model"), ("m.onnx.data", b"weights")):
            with open(os.path.join(os.path.dirname(tmp), name), "wb") as f:
                f.write(data)
    assert (tmp_path / "m.onnx").read_bytes() == b"model" and (tmp_path / "m.onnx.data").read_bytes() == b"weights"
    with pytest.raises(RuntimeError), atomic_output(tmp_path / "m.onnx") as tmp:
        with open(tmp + ".data", "wb") as f:
            f.write(b"new weights")
        raise RuntimeError("serializer failed")
    assert (tmp_path / "m.onnx.data").read_bytes() == b"weights" and _leftovers(tmp_path) == []


@pytest.fixture
def untouched(monkeypatch):
    """Fail the test if optimize runs: every path check must come before the work."""
    def no_work(*args, **kwargs):
        raise AssertionError("optimize ran before the output paths were checked")
    monkeypatch.setattr(automp.deploy, "optimize", no_work)


def _refused(argv, capsys, *needles) -> None:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and all(n in err for n in needles), err


@pytest.mark.parametrize("flag", ["-o", "--report"])
def test_an_output_that_is_an_input_is_refused(files, capsys, untouched, flag):
    src, calib, tmp = files
    model_bytes, calib_bytes = src.read_bytes(), calib.read_bytes()
    other = ["--report", str(tmp / "r.json")] if flag == "-o" else ["-o", str(tmp / "o.onnx")]
    _refused([str(src), flag, str(src), "--calib", str(calib)] + other, capsys, flag, "input model", "refusing")
    _refused([str(src), flag, str(calib), "--calib", str(calib)] + other, capsys, flag, "calibration file")
    spelled = tmp / "sub" / ".." / src.name
    (tmp / "sub").mkdir()
    _refused([str(src), flag, str(spelled)] + other, capsys, "input model")
    (tmp / "link.onnx").symlink_to(src)
    _refused([str(src), flag, str(tmp / "link.onnx")] + other, capsys, "input model")
    os.link(calib, tmp / "hard.npz")
    _refused([str(src), flag, str(tmp / "hard.npz"), "--calib", str(calib)] + other, capsys, "calibration file")
    assert src.read_bytes() == model_bytes and calib.read_bytes() == calib_bytes
    assert not (tmp / "r.json").exists() and not (tmp / "o.onnx").exists()


def test_output_and_report_on_one_file_are_refused(files, capsys, untouched):
    src, _, tmp = files
    _refused([str(src), "-o", str(tmp / "x"), "--report", str(tmp / "x")], capsys, "same file")


def test_unwritable_report_fails_before_the_model_is_written(files, capsys, untouched):
    src, _, tmp = files
    out = tmp / "out.onnx"
    _refused([str(src), "-o", str(out), "--report", str(tmp / "no" / "rep.json")], capsys, "--report",
             "does not exist")
    _refused([str(src), "-o", str(out), "--report", str(tmp)], capsys, "--report", "is a directory")
    _refused([str(src), "-o", str(tmp / "no" / "out.onnx")], capsys, "-o", "does not exist")
    assert not out.exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories and files")
def test_read_only_report_directory_or_file_fails_before_any_work(files, capsys, untouched):
    src, _, tmp = files
    locked, protected = tmp / "locked", tmp / "protected.json"
    locked.mkdir()
    locked.chmod(0o555)
    protected.write_text("{}")
    protected.chmod(0o444)
    try:
        _refused([str(src), "-o", str(tmp / "out.onnx"), "--report", str(locked / "r.json")], capsys, "--report",
                 "cannot write")
        _refused([str(src), "-o", str(tmp / "out.onnx"), "--report", str(protected)], capsys, "write-protected")
    finally:
        locked.chmod(0o755)
    assert not (tmp / "out.onnx").exists() and protected.read_text() == "{}"
