"""`automp bench train` on a machine without torchvision, and its option checking."""
import sys

import pytest

from automp.bench.suites import train


def test_without_torchvision_resnet50_is_a_one_line_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "torchvision", None)  # `import torchvision` raises ImportError
    assert train.main(["--quick", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "torchvision" in err and "pip install automp[zoo]" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag, value, listed", [("--models", "gpt124m,vgg", "gpt124m, resnet50"),
                                                 ("--modes", "fp32,fp8", "autocast-bf16+compile")])
def test_unknown_models_or_modes_are_usage_errors_listing_the_valid_ones(capsys, flag, value, listed):
    with pytest.raises(SystemExit) as e:
        train.main([flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and value.split(",")[1] in err and listed in err


def test_help_lists_the_models_and_documents_every_option():
    parser = train.build_parser()
    assert [a.dest for a in parser._actions if not (a.help or "").strip()] == []
    assert "gpt124m, resnet50" in next(a.help for a in parser._actions if a.dest == "models")


def test_quick_run_without_resnet50(tmp_path, capsys):
    out = tmp_path / "out"
    assert train.main(["--quick", "--models", "gpt124m", "--modes", "fp32", "--warmup", "0", "--iters", "1",
                       "--out", str(out)]) == 0
    assert (out / "train.json").is_file() and "gpt124m fp32" in capsys.readouterr().out
