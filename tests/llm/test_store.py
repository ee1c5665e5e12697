"""automp.llm.save / load (exact round trip, atomic writes, mismatched files), built-in models, and the
`automp llm quantize | generate` commands that sit on them."""
import json
import os

import pytest
import torch

from automp.llm import cli
from automp.llm.quantize import QuantLinear, quantize
from automp.llm.store import META, WEIGHTS, build, load, load_source, save
from tests.llm import DEVICE


def ids(n: int = 8) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(5))


def state(model) -> dict:
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    return dict(named)


@pytest.mark.parametrize("name,kwargs", [
    ("tiny-llama", {"scheme": "int4", "awq": True}),                 # GQA: o_proj keeps an explicit input scale
    ("tiny-gpt2", {"scheme": "int8", "quantize_lm_head": False}),    # lm_head tied to the token embedding
    ("tiny-gpt2", {"scheme": "int4", "quantize_lm_head": True, "quantize_embeddings": True, "edge_scheme": "int8"}),
])
def test_round_trip_is_exact(tmp_path, name, kwargs):
    calib = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    q = quantize(build(name).to(DEVICE), group_size=32, calib=calib if kwargs.get("awq") else None, **kwargs)
    save(q, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == [META, WEIGHTS]  # no temporary files left behind
    r = load(str(tmp_path), device=DEVICE)
    a, b = state(q), state(r)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert {n: m.spec() for n, m in q.named_modules() if isinstance(m, QuantLinear)} == \
        {n: m.spec() for n, m in r.named_modules() if isinstance(m, QuantLinear)}
    assert r.automp_quant == q.automp_quant
    if name == "tiny-gpt2" and not kwargs.get("quantize_embeddings"):
        assert r.lm_head.weight is r.transformer.wte.weight  # the tie survives
    assert type(r.get_input_embeddings()) is type(q.get_input_embeddings())
    with torch.no_grad():
        assert torch.equal(q(input_ids=ids().to(DEVICE)).logits, r(input_ids=ids().to(DEVICE)).logits)


def test_failed_save_leaves_previous_model(tmp_path, monkeypatch):
    import safetensors.torch
    first = quantize(build("tiny-gpt2"), "int8", group_size=32)
    save(first, str(tmp_path))
    before = {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)}

    def broken(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        save(quantize(build("tiny-gpt2", seed=1), "int8", group_size=32), str(tmp_path))
    assert {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)} == before
    monkeypatch.undo()
    assert torch.equal(load(str(tmp_path)).transformer.h[0].attn.c_attn.qw, first.transformer.h[0].attn.c_attn.qw)


def test_files_from_different_saves_are_rejected(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    model = quantize(build("tiny-gpt2"), "int8", group_size=32)
    save(model, str(a))
    save(model, str(b))
    (a / META).write_text((b / META).read_text())
    with pytest.raises(ValueError, match="come from different saves"):
        load(str(a))


def test_load_and_save_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"has no {META}"):
        load(str(tmp_path))
    (tmp_path / META).write_text(json.dumps({"format": "something-else", "version": 1}))
    with pytest.raises(ValueError, match="is not an automp-llm v1 file"):
        load(str(tmp_path))
    with pytest.raises(ValueError, match="not quantized by automp.llm.quantize"):
        save(build("tiny-llama"), str(tmp_path / "out"))
    with pytest.raises(ValueError, match="unknown built-in model 'gpt-9'"):
        build("gpt-9")
    with pytest.raises(FileNotFoundError, match="neither a built-in model"):
        load_source(str(tmp_path / "missing"))


def test_build_is_seeded_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = build("tiny-llama")
    assert torch.equal(torch.rand(3), expected)
    b = build("tiny-llama")
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(build("tiny-llama", seed=1).lm_head.weight, a.lm_head.weight)


def test_cli_quantize_then_generate(tmp_path, capsys):
    out = str(tmp_path / "q")
    assert cli.main(["quantize", "--model", "tiny-gpt2", "--bits", "8", "--group-size", "32", "--device", "cpu",
                     "-o", out]) == 0
    assert "tiny-gpt2 -> " in capsys.readouterr().out
    assert cli.main(["generate", out, "--prompt", "hello", "--max-new-tokens", "2", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("hello") and "2 tokens in" in captured.err and "decode eager" in captured.err


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert cli.main(["quantize", "--model", "tiny-llama", "--group-size", "128", "--device", "cpu",
                     "-o", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "does not divide K=64" in err
    assert cli.main(["generate", str(tmp_path / "nothing"), "--prompt", "a", "--device", "cpu"]) == 1
    assert f"has no {META}" in capsys.readouterr().err


def test_cli_quantize_says_how_many_sibling_groups_it_fused(tmp_path, capsys):
    from automp.llm.fuse import fused_groups
    from automp.llm.store import load
    out = str(tmp_path / "q")
    assert cli.main(["quantize", "--model", "tiny-llama", "--bits", "4", "--group-size", "32", "--device", "cpu",
                     "-o", out]) == 0
    said = capsys.readouterr().out
    groups = len(fused_groups(load(out, "cpu")))
    assert groups > 0 and f", {groups} sibling projection groups fused" in said
    assert cli.main(["quantize", "--model", "tiny-llama", "--bits", "4", "--group-size", "32", "--device", "cpu",
                     "--no-fuse", "-o", str(tmp_path / "plain")]) == 0
    assert "fused" not in capsys.readouterr().out
