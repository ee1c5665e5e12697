"""The report's picture: what it draws is read back from the figure's data and compared with the report."""
import struct

import pytest

from automp.precision.fp8 import choice
from automp.runtime import report_plot


def _layer(dtype, gain, error, rule):
    return {"dtype": dtype, "predicted_gain": gain, "measured_error": error, "rule": rule, "shape": [64, 64, 64],
            "recipe": "tensorwise"}


LAYERS = {"l0": _layer("fp8", 1.5, 0.04, choice.FP8), "l1": _layer("bf16", 1.02, 0.05, choice.NO_GAIN),
          "l2": _layer("bf16", 1.8, 0.3, choice.ACCURACY), "l3": _layer("bf16", None, None, choice.NOT_MEASURED)}


def report(fp8=True, **fp8_over):
    choices = [{"module": "GPT", "path": "stock-inductor", "rule": "fastest", "reason": "fastest",
                "timings_ms": {"automp-compiled": 12.5, "stock-inductor": 10.25, "fp32-eager": 30.0},
                "cached": False, "confirmed": True},
               {"module": "Head", "path": "fp32-eager", "rule": "fastest", "reason": "fastest",
                "timings_ms": {"low-eager": 4.0, "fp32-eager": 3.5}, "cached": False, "confirmed": True}]
    out = {"device": "cuda", "dtype": "bfloat16", "graphs": [], "choices": choices}
    if fp8:
        out["fp8"] = {"GPT": {"recipe": "tensorwise", "fp8_layers": 1, "layers_seen": 4, "rules": {},
                              "layers": LAYERS, **fp8_over}}
    return out


def png_size(path):
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_the_bars_are_the_reports_timings_the_chosen_one_highlighted():
    fig = report_plot.figure(report())
    for ax, c in zip(fig.axes, report()["choices"]):
        assert [p.get_width() for p in ax.patches] == list(c["timings_ms"].values())
        assert [t.get_text() for t in ax.get_yticklabels()] == list(c["timings_ms"])
        chosen = list(c["timings_ms"]).index(c["path"])
        colours = [p.get_facecolor() for p in ax.patches]
        assert all((colour == colours[chosen]) == (i == chosen) for i, colour in enumerate(colours))
        assert c["path"] in ax.get_title(loc="left") and c["rule"] in ax.get_title(loc="left")


def test_the_scatter_is_each_measured_layers_gain_and_error():
    ax = report_plot.figure(report()).axes[2]
    plotted = [tuple(p) for p in ax.collections[0].get_offsets()]
    assert plotted == [(1.5, 0.04), (1.02, 0.05), (1.8, 0.3)]  # l3 has neither: left off, and said so
    assert "1 without a gain or an error" in ax.get_title(loc="left")
    colours = ax.collections[0].get_facecolors()
    assert (colours[0] != colours[1]).any() and (colours[1] == colours[2]).all()


def _threshold_lines(ax):
    vertical = [line.get_xdata()[0] for line in ax.lines if line.get_xdata()[0] == line.get_xdata()[1]]
    horizontal = [line.get_ydata()[0] for line in ax.lines if line.get_ydata()[0] == line.get_ydata()[1]]
    return vertical, horizontal


def test_the_thresholds_are_the_defaults_and_say_so():
    ax = report_plot.figure(report()).axes[2]
    assert _threshold_lines(ax) == ([choice.MIN_GAIN], [choice.MAX_ERROR])
    assert "automp's defaults" in ax.get_title(loc="left")


def test_thresholds_the_report_carries_are_used():
    ax = report_plot.figure(report(min_gain=1.3, max_error=0.2)).axes[2]
    assert _threshold_lines(ax) == ([1.3], [0.2])
    assert "defaults" not in ax.get_title(loc="left")


def test_a_report_without_fp8_has_only_the_timing_panels():
    fig = report_plot.figure(report(fp8=False))
    assert len(fig.axes) == 2 and all(not ax.collections for ax in fig.axes)


def test_a_cached_verdict_says_it_has_no_timings():
    r = report(fp8=False)
    r["choices"] = [{"module": "GPT", "path": "stock-inductor", "reason": "cached", "timings_ms": {}, "cached": True}]
    (ax,) = report_plot.figure(r).axes
    assert not ax.patches and "verdict from cache" in " ".join(t.get_text() for t in ax.texts)


def test_the_png_has_the_stated_pixel_size(tmp_path):
    out = tmp_path / "plot.png"
    report_plot.save_plot(report(), out)
    assert png_size(out) == report_plot.pixel_size(report()) == (report_plot.WIDTH_PX, 3 * report_plot.PANEL_PX)


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    from matplotlib.figure import Figure
    out = tmp_path / "plot.png"
    out.write_bytes(b"before")

    def half_written(self, fname, **kwargs):
        with open(fname, "wb") as f:
            f.write(b"\x89PNG")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", half_written)
    with pytest.raises(OSError):
        report_plot.save_plot(report(), out)
    assert out.read_bytes() == b"before" and sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]
