"""`automp bench deploy_gpu` argument handling and its pieces that need no GPU (the run itself is the lead's)."""
import pytest
import torch

from automp.bench.suites import deploy_gpu


def test_defaults_full_and_quick():
    full = deploy_gpu.parse([])
    assert (full.models, full.batches, full.seq, full.sentences) == (["minilm", "bert-base"], [1, 64], 128, 256)
    assert full.modes == list(deploy_gpu.MODES)
    quick = deploy_gpu.parse(["--quick", "--modes", "int8"])
    assert quick.modes == ["anchor", "int8"] and quick.batches == [1, 2] and quick.seq == 32  # ratios need it


@pytest.mark.parametrize("argv", [["--models", "resnet"], ["--modes", "int2"], ["--batches", "1,x"],
                                  ["--batches", "0"]])
def test_bad_arguments_exit_with_a_message(argv, capsys):
    with pytest.raises(SystemExit):
        deploy_gpu.parse(argv)
    assert "error:" in capsys.readouterr().err


def test_texts_and_pooling():
    docs = deploy_gpu.texts(5, seed=0)
    assert len(docs) == 5 and docs == deploy_gpu.texts(5, seed=0) and all(d.endswith(".") for d in docs)

    class Hidden(torch.nn.Module):
        def forward(self, input_ids, attention_mask):
            return type("Out", (), {"last_hidden_state": input_ids[..., None].float().repeat(1, 1, 2)})
    ids = torch.tensor([[1, 3, 9]])
    pooled = deploy_gpu.MeanPooled(Hidden())(ids, torch.tensor([[1, 1, 0]]))
    assert torch.equal(pooled, torch.tensor([[2.0, 2.0]]))  # the padded token is left out


def test_encoder_rows_name_the_int8_cases_and_skip_the_anchors():
    from automp.bench.harness import Result

    def row(name, ms, anchor_ms, batch):
        return Result("deploy_gpu", name, ms, "torch.compile fp16", anchor_ms, {"batch": batch, "cos_min": 0.99712})
    results = [row("bert-base seq128 bs64 anchor", 3.6, 3.6, 64),
               row("bert-base seq128 bs64 int8-static", 3.1, 3.6, 64),
               row("minilm-L6 (real weights) seq128 bs1 int8", 0.6, 0.4, 1),
               row("minilm-L6 (real weights) seq128 bs1 int4-weight", 0.8, 0.4, 1),
               row("bert-base seq128 bs1 int8", float("nan"), 0.8, 1)]  # skipped by the time limit
    rows = deploy_gpu.encoder_rows(results)
    assert rows == [
        {"model": "bert-base", "case": "int8", "activations": "static", "batch": 64, "ms": 3.1, "anchor_ms": 3.6,
         "cos_min": 0.99712},
        {"model": "minilm", "case": "int8", "activations": "dynamic", "batch": 1, "ms": 0.6, "anchor_ms": 0.4,
         "cos_min": 0.99712},
        {"model": "minilm", "case": "int4-weight", "activations": None, "batch": 1, "ms": 0.8, "anchor_ms": 0.4,
         "cos_min": 0.99712}]
    md = deploy_gpu.encoder_markdown(rows, "automp bench deploy_gpu")
    assert "| bert-base | int8 | static | 64 | 3.100 | 3.600 | 1.16x | 0.99712 |" in md
