import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from automp import protect
from automp.deploy import runtime
from automp.quant.ptq.compare import compare

from .test_obfuscate import names


@pytest.fixture
def model_file(exported, tmp_path):
    path = tmp_path / "net.onnx"
    onnx.save(exported("cnn"), path)
    return path


def test_cli_writes_the_model_and_the_report(model_file, tmp_path, capsys):
    out, rep = tmp_path / "out.onnx", tmp_path / "r.json"
    assert protect.main([str(model_file), "-o", str(out), "--seed", "3", "--ratio", "0.5", "--report", str(rep)]) == 0
    src, got = onnx.load(model_file), onnx.load(out)
    onnx.checker.check_model(got, full_check=True)
    feeds = runtime.random_feeds(src, batch=3, seed=1)
    assert compare(runtime.run(got, feeds)["logits"], runtime.run(src, feeds)["logits"]).rel_l2 <= 1e-5
    assert names(got) & names(src) == {"image", "logits"}
    data = json.loads(rep.read_text())
    assert data["output"] == str(out) and data["bytes"]["file"] == out.stat().st_size and data["deterministic"]
    assert "wrote" in capsys.readouterr().out


def test_cli_with_a_key_writes_an_encrypted_model(model_file, tmp_path):
    out, key = tmp_path / "enc.onnx", "ab" * 32
    assert protect.main([str(model_file), "-o", str(out), "--key", key, "--seed", "0"]) == 0
    src = onnx.load(model_file)
    feeds = runtime.random_feeds(src, batch=2, seed=5)
    got = protect.session(out, key).run(None, feeds)[0]
    assert compare(got, runtime.run(src, feeds)["logits"]).rel_l2 <= 1e-5


@pytest.mark.parametrize("flag", ["-o", "--report"])
def test_cli_refuses_to_overwrite_the_input(model_file, tmp_path, capsys, flag):
    before = model_file.read_bytes()
    argv = [str(model_file), "-o", str(tmp_path / "o.onnx")] if flag == "--report" else [str(model_file)]
    argv += [flag, str(model_file)]
    assert protect.main(argv) == 1
    err = capsys.readouterr().err
    assert "refusing to overwrite" in err and "input model" in err
    assert model_file.read_bytes() == before


def test_cli_refuses_to_overwrite_the_key_file_or_one_file_twice(model_file, tmp_path, capsys):
    key = tmp_path / "key.txt"
    key.write_text(bytes(range(32)).hex() + "\n")
    before = key.read_bytes()
    assert protect.main([str(model_file), "-o", str(key), "--key", str(key)]) == 1
    assert "key file" in capsys.readouterr().err and key.read_bytes() == before
    same = str(tmp_path / "x.onnx")
    assert protect.main([str(model_file), "-o", same, "--report", same]) == 1
    assert "same file" in capsys.readouterr().err


def test_cli_reports_bad_input_in_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(np.random.default_rng(0).bytes(200))
    assert protect.main([str(bad), "-o", str(tmp_path / "o.onnx")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("automp protect: error:") and "bad.onnx" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o.onnx").exists()
    with pytest.raises(SystemExit) as e:  # a malformed key is a usage error, found before the model is read
        protect.main([str(bad), "-o", str(tmp_path / "o.onnx"), "--key", "zz"])
    assert e.value.code == 2 and "key" in capsys.readouterr().err


@pytest.mark.parametrize("ratio", ["1.5", "-1", "x"])
def test_cli_rejects_a_ratio_outside_zero_one(model_file, tmp_path, capsys, ratio):
    with pytest.raises(SystemExit) as e:
        protect.main([str(model_file), "-o", str(tmp_path / "o.onnx"), "--ratio", ratio])
    assert e.value.code == 2 and "--ratio" in capsys.readouterr().err


def test_a_seed_gives_the_same_file_in_separate_processes(exported, tmp_path):
    """Nothing may depend on Python's per-process string hashing (set order): two runs with different
    PYTHONHASHSEED write byte-identical files, encryption included."""
    src = tmp_path / "net.onnx"
    onnx.save(exported("encoder"), src)
    repo = Path(__file__).resolve().parents[2]
    procs = []
    for h in ("1", "2"):
        env = dict(os.environ, PYTHONPATH=str(repo / "src"), PYTHONHASHSEED=h, OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "automp.protect", str(src), "-o", str(tmp_path / f"o{h}.onnx"), "--seed",
               "5", "--ratio", "0.5", "--key", "00112233445566778899aabbccddeeff" * 2]
        procs.append(subprocess.Popen(cmd, env=env, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()
    assert (tmp_path / "o1.onnx").read_bytes() == (tmp_path / "o2.onnx").read_bytes()


def test_a_key_file_from_openssl_and_its_hex_string_are_the_same_key(model_file, tmp_path):
    """The tool's advice `openssl rand -hex 32 > key.txt`: the model written with the file opens with the digits
    given directly, and with the file without its newline."""
    digits = bytes(range(100, 132)).hex()
    key = tmp_path / "key.txt"
    key.write_text(digits + "\n")
    out = tmp_path / "enc.onnx"
    assert protect.main([str(model_file), "-o", str(out), "--key", str(key), "--seed", "0"]) == 0
    bare = tmp_path / "bare.txt"
    bare.write_text(digits)
    a, b, c = (protect.load(out, k) for k in (digits, str(bare), str(key)))
    assert a.SerializeToString() == b.SerializeToString() == c.SerializeToString()


@pytest.mark.parametrize("key", ["ab" * 16, "ab" * 33, "xy" * 32, "file:binary", "file:short"],
                         ids=["32-digits", "66-digits", "not-hex", "binary-file", "short-file"])
def test_a_bad_key_is_a_usage_error_that_says_what_is_expected(model_file, tmp_path, capsys, key):
    if key.startswith("file:"):
        path = tmp_path / "key.bin"
        path.write_bytes(bytes(range(32)) if key == "file:binary" else b"abcd\n")
        key = str(path)
    out = tmp_path / "o.onnx"
    with pytest.raises(SystemExit) as e:
        protect.main([str(model_file), "-o", str(out), "--key", key])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and err.startswith("automp protect: error: argument --key:")
    assert "expected a key of 64 hex characters (32 bytes" in err and not out.exists()


def test_every_option_has_help():
    from automp.protect.cli import build_parser
    assert [a.dest for a in build_parser()._actions if not (a.help or "").strip()] == []


def _external(tmp_path, model, location):
    src = tmp_path / "ext.onnx"
    (tmp_path / location).parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, src, save_as_external_data=True, location=location, size_threshold=0)
    return src, tmp_path / location


@pytest.mark.parametrize("location", ["ext.onnx.data", "sub/weights.bin"])
@pytest.mark.parametrize("flag", ["-o", "--report"])
def test_cli_refuses_to_write_over_the_inputs_external_data(exported, tmp_path, capsys, location, flag):
    src, data = _external(tmp_path, exported("cnn"), location)
    before = data.read_bytes()
    feeds = runtime.random_feeds(onnx.load(src), batch=2, seed=int(np.random.default_rng().integers(1 << 30)))
    ref = runtime.run(onnx.load(src), feeds)["logits"]
    argv = [str(src), "-o", str(data)] if flag == "-o" else [str(src), "-o", str(tmp_path / "o.onnx"), flag,
                                                             str(data)]
    assert protect.main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "external data" in err and "refusing to overwrite" in err and flag in err
    assert data.read_bytes() == before and not (tmp_path / "o.onnx").exists()
    np.testing.assert_array_equal(runtime.run(onnx.load(src), feeds)["logits"], ref)


def test_cli_refuses_an_output_whose_own_data_file_is_the_inputs(exported, tmp_path, capsys):
    src, data = _external(tmp_path, exported("cnn"), "out.onnx.data")
    before = data.read_bytes()
    assert protect.main([str(src), "-o", str(tmp_path / "out.onnx")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "out.onnx.data" in err and "external data" in err
    assert data.read_bytes() == before and not (tmp_path / "out.onnx").exists()


def _embedding() -> onnx.ModelProto:
    """ids (int64) -> Gather from a random table -> MatMul: an integer input next to float weights."""
    from onnx import helper
    from ..deploy.util import f32, init, model
    rng = np.random.default_rng()
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"], name="emb"),
             helper.make_node("MatMul", ["e", "w"], ["y"], name="proj")]
    ids = helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["n", 4])
    return model(nodes, [ids], [f32("y", ["n", 4, 3])],
                 [init("table", rng.standard_normal((10, 6)).astype(np.float32)),
                  init("w", rng.standard_normal((6, 3)).astype(np.float32))])


def test_the_summary_describes_float_and_integer_inputs_as_they_are(model_file, tmp_path, capsys):
    out, rep = tmp_path / "o.onnx", tmp_path / "r.json"
    assert protect.main([str(model_file), "-o", str(out), "--report", str(rep)]) == 0
    line = next(s for s in capsys.readouterr().out.splitlines() if "rel. error" in s)
    said = json.loads(rep.read_text())["error_vs_original"]["inputs"]
    assert said in line and "integer" not in said and "standard normal" in said and "image" in said
    ints = tmp_path / "emb.onnx"
    onnx.save(_embedding(), ints)
    assert protect.main([str(ints), "-o", str(out), "--report", str(rep)]) == 0
    line = next(s for s in capsys.readouterr().out.splitlines() if "rel. error" in s)
    said = json.loads(rep.read_text())["error_vs_original"]["inputs"]
    assert said in line and "integers in [0, 2)" in said and "ids" in said and "standard normal" not in said
