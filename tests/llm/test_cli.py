"""`automp llm quantize | generate` on bad input: an output that would destroy the source model, saves over earlier
saves (nothing of them survives, an interrupted save's leftovers are cleaned), damaged weights, a missing optional
package, and the help text of every option."""
import os
import subprocess
import sys

import pytest

from automp.llm import cli
from automp.llm.quantize import quantize
from automp.llm.store import META, WEIGHTS, build, load, load_tokenizer, save

QUANT = ["--bits", "8", "--group-size", "32", "--device", "cpu"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A transformers model directory, as `save_pretrained` writes it."""
    path = tmp_path_factory.mktemp("hf") / "model"
    build("tiny-gpt2").save_pretrained(str(path))
    return path


def snapshot(path) -> dict:
    return {f: (path / f).read_bytes() for f in sorted(os.listdir(path))}


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    return err


@pytest.mark.parametrize("where", ["same", "same-spelled-differently", "inside", "around"])
def test_quantize_refuses_an_output_that_would_overwrite_the_source(hf_dir, capsys, where):
    before = snapshot(hf_dir)
    out = {"same": hf_dir, "same-spelled-differently": hf_dir / ".." / hf_dir.name, "inside": hf_dir / "q",
           "around": hf_dir.parent}[where]
    assert cli.main(["quantize", "--model", str(hf_dir), *QUANT, "-o", str(out)]) == 2
    err = one_line_error(capsys)
    assert err.startswith("automp llm quantize: error: -o ") and "source model" in err
    assert snapshot(hf_dir) == before and not (hf_dir / "q").exists()


def test_quantize_refuses_to_replace_a_directory_of_other_files(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert cli.main(["quantize", "--model", "tiny-gpt2", *QUANT, "-o", str(tmp_path)]) == 2
    assert "not an automp quantized model" in one_line_error(capsys)
    assert os.listdir(tmp_path) == ["notes.txt"]


def test_a_local_model_without_tokenizer_files_generates_with_the_byte_tokenizer(hf_dir, tmp_path, capsys):
    """transformers builds a tokenizer with an empty vocabulary for a directory without tokenizer files: saving that
    one made every prompt encode to no tokens."""
    out = tmp_path / "q"
    assert cli.main(["quantize", "--model", str(hf_dir), *QUANT, "-o", str(out)]) == 0
    assert sorted(os.listdir(out)) == [META, WEIGHTS]
    capsys.readouterr()
    assert cli.main(["generate", str(out), "--prompt", "hi", "--max-new-tokens", "1", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("hi")


class FakeTokenizer:
    """What an earlier save with a transformers tokenizer left in its directory."""

    def save_pretrained(self, directory):
        for name in ("tokenizer.json", "tokenizer_config.json"):
            with open(os.path.join(directory, name), "w") as f:
                f.write("{}")


def test_a_save_replaces_the_whole_earlier_save(tmp_path, capsys):
    out = tmp_path / "q"
    save(quantize(build("tiny-gpt2"), "int8", group_size=32), str(out), tokenizer=FakeTokenizer())
    assert "tokenizer_config.json" in os.listdir(out)
    assert cli.main(["quantize", "--model", "tiny-gpt2", *QUANT, "-o", str(out)]) == 0
    assert sorted(os.listdir(out)) == [META, WEIGHTS]  # the earlier tokenizer is gone with the earlier weights
    assert type(load_tokenizer(str(out))).__name__ == "ByteTokenizer"
    assert sorted(os.listdir(tmp_path)) == ["q"]  # no temporary sibling left


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_save_removes_temporaries_of_killed_saves_and_load_ignores_them(tmp_path):
    out = tmp_path / "q"
    model = quantize(build("tiny-gpt2"), "int8", group_size=32)
    save(model, str(out))
    stale = tmp_path / f".q.automp-tmp-{dead_pid()}-0a1b2c3d"  # what kill -9 during a save leaves
    stale.mkdir()
    (stale / WEIGHTS).write_bytes(b"half a file")
    live = tmp_path / f".q.automp-tmp-{os.getpid()}-0a1b2c3d"  # a save still running in this process
    live.mkdir()
    other = tmp_path / f".other.automp-tmp-{dead_pid()}-0a1b2c3d"  # another output's: not this save's to judge
    other.mkdir()
    load(str(out))  # reads the directory it is given, never a temporary beside it
    save(model, str(out))
    assert not stale.exists() and live.is_dir() and other.is_dir()
    assert sorted(os.listdir(out)) == [META, WEIGHTS]


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_generate_with_damaged_weights_is_a_one_line_error(tmp_path, capsys, damage):
    out = tmp_path / "q"
    assert cli.main(["quantize", "--model", "tiny-gpt2", *QUANT, "-o", str(out)]) == 0
    weights = out / WEIGHTS
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x00" * 8 + data[8:100])
    capsys.readouterr()
    assert cli.main(["generate", str(out), "--prompt", "hi", "--max-new-tokens", "1", "--device", "cpu"]) == 1
    err = one_line_error(capsys)
    assert str(weights) in err and "not a readable safetensors file" in err


@pytest.mark.parametrize("missing", ["transformers", "safetensors"])
@pytest.mark.parametrize("command", [["quantize", "--model", "tiny-gpt2", "-o", "never-written"],
                                     ["generate", "some-dir", "--prompt", "a"]])
def test_without_the_llm_extra_the_command_says_how_to_install_it(monkeypatch, capsys, missing, command):
    monkeypatch.setitem(sys.modules, missing, None)  # `import transformers` raises ImportError
    assert cli.main(command) == 2
    err = one_line_error(capsys)
    assert f"needs the {missing} package: pip install automp[llm]" in err
    assert not os.path.exists("never-written")


def test_llm_cli_does_not_run_the_benchmark_itself(capsys):
    assert cli.main(["bench", "--quick"]) == 2
    assert "automp llm bench" in one_line_error(capsys)


def subparsers(parser):
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return action.choices


def undocumented(parser) -> list[str]:
    return [a.dest for a in parser._actions if not (a.help or "").strip()]


def test_every_option_of_quantize_and_generate_has_help():
    subs = subparsers(cli.build_parser())
    for name in ("quantize", "generate"):
        assert undocumented(subs[name]) == [], name


def test_generate_with_the_decode_attention_kernel_gives_the_models_text(tmp_path, capsys):
    """--attention kernel (here on the CPU: the op's reference, steps run eagerly) continues the prompt as the model's
    own attention does, and the summary line names the attention that ran."""
    out = tmp_path / "q"
    assert cli.main(["quantize", "--model", "tiny-llama", *QUANT, "-o", str(out)]) == 0
    texts, lines = {}, {}
    for attention in ("model", "kernel"):
        capsys.readouterr()
        assert cli.main(["generate", str(out), "--prompt", "def f(", "--max-new-tokens", "6", "--device", "cpu",
                         "--attention", attention]) == 0
        got = capsys.readouterr()
        texts[attention], lines[attention] = got.out, got.err.strip().splitlines()[-1]
    assert texts["kernel"] == texts["model"] and texts["model"].startswith("def f(")
    assert "attention kernel" in lines["kernel"] and "attention model" in lines["model"]
