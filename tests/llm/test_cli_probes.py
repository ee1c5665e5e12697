"""`automp llm quantize | generate` on what probes of the command found: damaged files of a source model directory
and of automp's own store, --device cuda on a machine without CUDA, and generated text (random weights of the
built-in models) that must not reach the terminal as raw control characters."""
import os
import random

import pytest
import torch

from automp.llm import cli
from automp.llm.quantize import quantize
from automp.llm.store import WEIGHTS, build, save

QUANT = ["--bits", "8", "--group-size", "32", "--device", "cpu"]


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert "Traceback" not in err, err
    return err


def tiny_transformers_dir(path, seed: int):
    """A transformers model directory (config.json + model.safetensors) of a small random GPT-2."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    config = transformers.GPT2Config(vocab_size=256, n_embd=32, n_layer=1, n_head=2, n_positions=128,
                                     bos_token_id=None, eos_token_id=None)
    torch.manual_seed(seed)
    transformers.GPT2LMHeadModel(config).save_pretrained(str(path))
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    return path


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A directory written by `automp llm quantize` of a built-in model."""
    out = tmp_path_factory.mktemp("store") / "q"
    assert cli.main(["quantize", "--model", "tiny-gpt2", *QUANT, "-o", str(out)]) == 0
    return out


# ------------------------------------------------------------------------------------------- 1: damaged files
@pytest.mark.parametrize("where", ["data", "header"])
def test_quantize_of_a_model_dir_with_truncated_safetensors_is_one_line_naming_the_file(tmp_path, capsys, where):
    rng = random.Random()
    src = tiny_transformers_dir(tmp_path / "hf", seed=rng.randrange(2**31))
    weights = src / "model.safetensors"
    data = weights.read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    cut = rng.randrange(header + 1, len(data)) if where == "data" else rng.randrange(1, header)
    weights.write_bytes(data[:cut])
    out = tmp_path / "q"
    capsys.readouterr()  # what building the directory printed
    assert cli.main(["quantize", "--model", str(src), *QUANT, "-o", str(out)]) == 1
    err = one_line_error(capsys)
    assert err.startswith("automp llm quantize: error: ")
    assert str(weights) in err and "truncated or damaged" in err
    assert not out.exists()


def test_quantize_of_a_model_dir_with_a_truncated_pytorch_model_bin_is_one_line_naming_it(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    src = tmp_path / "hf"
    config = transformers.GPT2Config(vocab_size=256, n_embd=32, n_layer=1, n_head=2, n_positions=128)
    transformers.GPT2LMHeadModel(config).save_pretrained(str(src))
    (src / "model.safetensors").unlink()  # the older format, which transformers reads with torch.load
    weights = src / "pytorch_model.bin"
    torch.save(transformers.GPT2LMHeadModel(config).state_dict(), weights)
    data = weights.read_bytes()
    weights.write_bytes(data[: random.randrange(1, len(data) - 1)])
    out = tmp_path / "q"
    capsys.readouterr()
    assert cli.main(["quantize", "--model", str(src), *QUANT, "-o", str(out)]) == 1
    err = one_line_error(capsys)
    assert str(weights) in err and "truncated or damaged" in err and not out.exists()


def test_quantize_of_a_model_dir_with_an_unreadable_tokenizer_is_one_line_not_the_byte_tokenizer(tmp_path, capsys):
    """A tokenizer transformers cannot build is an error naming the directory, not a quiet fallback to bytes (the
    quantized model would be saved without its tokenizer, and generate would feed it byte ids)."""
    src = tiny_transformers_dir(tmp_path / "hf", seed=1)
    (src / "tokenizer_config.json").write_text('{"tokenizer_class": "NoSuchTokenizerClass"}')
    out = tmp_path / "q"
    capsys.readouterr()
    assert cli.main(["quantize", "--model", str(src), *QUANT, "-o", str(out)]) == 1
    err = one_line_error(capsys)
    assert f"the tokenizer files in {src} cannot be read" in err and not out.exists()


def test_generate_with_a_truncated_tokenizer_file_in_the_store_is_one_line_naming_it(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast
    vocab = {chr(i): i for i in range(32, 127)}
    vocab["[UNK]"] = 0
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    out = tmp_path / "q"
    save(quantize(build("tiny-gpt2"), "int8", group_size=32), str(out),
         tokenizer=PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]"))
    path = out / "tokenizer.json"
    data = path.read_bytes()
    path.write_bytes(data[: random.randrange(1, len(data) - 1)])
    capsys.readouterr()
    assert cli.main(["generate", str(out), "--prompt", "hi", "--max-new-tokens", "1", "--device", "cpu"]) == 1
    err = one_line_error(capsys)
    assert str(path) in err and "truncated or damaged" in err


def test_generate_with_truncated_weights_in_the_store_is_one_line_naming_them(store, tmp_path, capsys):
    out = tmp_path / "q"
    out.mkdir()
    for f in os.listdir(store):
        (out / f).write_bytes((store / f).read_bytes())
    data = (out / WEIGHTS).read_bytes()
    (out / WEIGHTS).write_bytes(data[: random.randrange(1, len(data) - 1)])
    assert cli.main(["generate", str(out), "--prompt", "hi", "--max-new-tokens", "1", "--device", "cpu"]) == 1
    err = one_line_error(capsys)
    assert str(out / WEIGHTS) in err and "truncated or damaged" in err


# ------------------------------------------------------------------------------------------- 2: --device cuda
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
@pytest.mark.parametrize("command", ["quantize", "generate"])
def test_device_cuda_without_cuda_says_so_in_one_line(store, tmp_path, capsys, monkeypatch, command, device):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "never-written"
    argv = (["quantize", "--model", "tiny-gpt2", "--bits", "8", "--group-size", "32", "-o", str(out)]
            if command == "quantize" else ["generate", str(store), "--prompt", "hi", "--max-new-tokens", "1"])
    assert cli.main([*argv, "--device", device]) == 2
    err = one_line_error(capsys)
    assert err.startswith(f"automp llm {command}: error: --device {device}: ")
    assert "CUDA was asked for" in err and "no CUDA device is available" in err
    assert not out.exists()


@pytest.mark.parametrize("device,says", [("banana", "not a device"), ("mps", "runs on cpu or cuda")])
def test_a_device_automp_llm_cannot_use_is_one_line(tmp_path, capsys, device, says):
    out = tmp_path / "never-written"
    assert cli.main(["quantize", "--model", "tiny-gpt2", "-o", str(out), "--device", device]) == 2
    err = one_line_error(capsys)
    assert err.startswith(f"automp llm quantize: error: --device {device}: ") and says in err
    assert not out.exists()


# ------------------------------------------------------------------------------------------- 3: random text
def test_generate_of_a_built_in_model_says_its_text_is_noise(store, capsys):
    assert cli.main(["generate", str(store), "--prompt", "hi", "--max-new-tokens", "2", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if line.startswith("note: ")]
    assert notes == ["note: tiny-gpt2 is a built-in model with random weights; its text is noise"]


def test_generate_of_a_local_model_has_no_built_in_note(tmp_path, capsys):
    src = tiny_transformers_dir(tmp_path / "hf", seed=random.randrange(2**31))
    out = tmp_path / "q"
    assert cli.main(["quantize", "--model", str(src), *QUANT, "-o", str(out)]) == 0
    assert cli.main(["generate", str(out), "--prompt", "hi", "--max-new-tokens", "2", "--device", "cpu"]) == 0
    assert "built-in" not in capsys.readouterr().err


def raw_controls(text: str) -> list[str]:
    return [c for c in text if not c.isprintable() and c not in "\n\t"]


def test_generate_never_prints_raw_control_characters(store, capsys):
    prompt = "\x1b[2J\x07a\tb\rc\x9b"  # clear screen, bell, a tab (kept), carriage return, C1 CSI
    seed = random.randrange(2**31)
    assert cli.main(["generate", str(store), "--prompt", prompt, "--max-new-tokens", "64", "--temperature", "2",
                     "--seed", str(seed), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert raw_controls(out) == [], (seed, out)
    assert out.startswith("\\x1b[2J\\x07a\tb\\rc")  # escaped where it was, readable


def test_printable_escapes_what_a_terminal_would_act_on():
    keep = "plain ascii, ünïcödé, \ufffd, a\tb\nc"
    assert cli.printable(keep) == keep
    for c in ["\x00", "\x1b", "\r", "\x08", "\x7f", "\x85", "\x9b", "\u202e", "\u2028"]:
        text = f"x{c}y"
        escaped = cli.printable(text)
        assert raw_controls(escaped) == [] and escaped != text and escaped.startswith("x\\")
