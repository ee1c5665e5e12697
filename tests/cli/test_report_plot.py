"""`automp report REPORT --plot OUT.png`: prints the report as before and writes its picture; a bad report or an
output it cannot write is a one-line error, and no file."""
import json

from automp.cli import main
from tests.runtime.test_report_plot import png_size, report


def _saved(tmp_path, content):
    path = tmp_path / "rep.json"
    path.write_text(json.dumps(content))
    return str(path)


def test_plot_writes_the_png_and_prints_the_report(tmp_path, capsys):
    out = tmp_path / "plot.png"
    assert main(["report", _saved(tmp_path, report()), "--plot", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "GPT" in printed and "runs stock-inductor" in printed and f"wrote {out}" in printed
    assert png_size(out) == (1000, 1200)


def test_plot_of_a_report_without_fp8_has_only_the_timing_panels(tmp_path):
    out = tmp_path / "plot.png"
    assert main(["report", _saved(tmp_path, report(fp8=False)), "--plot", str(out)]) == 0
    assert png_size(out) == (1000, 800)


def test_not_a_report_is_a_one_line_error_and_no_plot(tmp_path, capsys):
    out = tmp_path / "plot.png"
    for path in (str(tmp_path / "missing.json"), _saved(tmp_path, {"device": "cpu"})):
        assert main(["report", path, "--plot", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("automp report: ") and "\n" not in err and path in err
    assert not out.exists()


def test_an_unwritable_output_is_a_one_line_error_naming_it(tmp_path, capsys):
    out = tmp_path / "no-such-dir" / "plot.png"
    assert main(["report", _saved(tmp_path, report()), "--plot", str(out)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("automp report: ") and "\n" not in err and str(out) in err
    assert captured.out == "" and not out.parent.exists()
