"""`automp bench distill --quick` on CPU: runs, writes its JSON and markdown, and the numbers are what it says."""
import json
import os

import pytest
import torch

from automp.bench.suites import distill


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOMP_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_quick_run_writes_consistent_results(tmp_path, dtype):
    threads = torch.get_num_threads()
    assert distill.main(["--quick", "--seeds", "2", "--dtype", dtype, "--device", "cpu", "--out", str(tmp_path)]) == 0
    assert torch.get_num_threads() == threads  # restored
    data = json.load(open(tmp_path / "distill.json"))
    assert data["meta"]["dtype"] == dtype and data["setup"]["steps"] == distill.QUICK.steps
    seeds, summary = data["seeds"], data["summary"]
    assert len(seeds) == 2 and summary["seeds"] == 2
    for r in seeds:
        for key in ("teacher_acc", "alone_acc", "kd_acc"):
            assert 0.0 <= r[key] <= 1.0
        assert r["teacher_acc"] > 0.5  # the teacher learned something (4 classes: chance is 0.25)
    margins = [r["kd_acc"] - r["alone_acc"] for r in seeds]
    assert summary["margin"] == pytest.approx(sum(margins) / 2)
    assert summary["kd_better_seeds"] == sum(m > 0 for m in margins)
    if dtype == "fp16":  # both students ran under automp, with loss scaling
        info = seeds[0]["automp"]
        assert info["kd"]["paths"] == {"Distiller": "low-precision-eager"}
        assert info["alone"]["loss_scale"]["steps"] == distill.QUICK.steps
    md = open(tmp_path / "distill.md").read()
    assert "student + KD" in md and f"{100 * summary['kd_acc']:.1f}" in md


def test_same_init_and_batches_without_teacher_give_the_same_student():
    """The two runs differ only by KD: trained alone twice from one init, two students come out identical."""
    setup = distill.Setup(labeled=64, steps=5, teacher_steps=1, eval_size=10)
    torch.manual_seed(0)
    x, y = torch.randn(64, 1, 12, 12), torch.randint(0, 4, (64,))
    a = distill.student_cnn(4)
    b = distill.student_cnn(4)
    b.load_state_dict(a.state_dict())
    distill.train_student(a, None, x, y, setup, seed=0, dtype="fp32")
    distill.train_student(b, None, x, y, setup, seed=0, dtype="fp32")
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_bad_arguments(tmp_path):
    for argv in (["--seeds", "0"], ["--labeled", "0"], ["--threads", "0"], ["--dtype", "int8"]):
        with pytest.raises(SystemExit):
            distill.main(argv + ["--out", str(tmp_path)])
    assert not os.path.exists(tmp_path / "distill.json")
