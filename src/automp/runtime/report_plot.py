"""A picture of a saved report's decisions (`automp report REPORT --plot OUT.png`).

The printed report names each choice; the picture shows the margins behind it: how far apart the candidate paths'
step times were, and, under FP8, where every linear layer fell against the two lines that decided it (the minimum
predicted gain, the largest measured error). A choice made by a hair reads differently from one made by a mile.

The figure is built on matplotlib's `Figure` directly, never pyplot, and matplotlib is imported only here, inside the
functions: `import automp` and every other command stay free of it, and no global figure state or GUI backend is
touched. Its size is fixed so that a picture's pixel size is known: WIDTH_PX wide, PANEL_PX tall per panel.
"""
from __future__ import annotations

import math
import os
from typing import Any

DPI = 100
WIDTH_PX = 1000
PANEL_PX = 400  # one panel per root module's timings, one more per module with FP8 layers
CHOSEN, OTHER = "tab:orange", "tab:blue"  # the chosen path's bar, the other candidates'
FP8_COLOUR, BF16_COLOUR = "tab:green", "tab:gray"


def _number(value: Any) -> float | None:
    """A finite number from the report, else None: a saved file is read as given, and a bad value is left off the
    picture rather than failing it (the printed report already checked the parts it reads)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def fp8_thresholds(fp8: dict[str, Any]) -> tuple[float, float, bool]:
    """(min_gain, max_error, from_report) for one module's FP8 entry: its own "min_gain" and "max_error" where it
    carries them, else automp.precision.fp8.choice's defaults, which the runtime decides with."""
    from automp.precision.fp8 import choice
    gain, error = _number(fp8.get("min_gain")), _number(fp8.get("max_error"))
    if gain is not None and error is not None:
        return gain, error, True
    return choice.MIN_GAIN if gain is None else gain, choice.MAX_ERROR if error is None else error, False


def _fp8_modules(report: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    fp8 = report.get("fp8") or {}
    return [(m, entry) for m, entry in fp8.items() if isinstance(entry, dict) and entry.get("layers")]


def panels(report: dict[str, Any]) -> int:
    """How many panels the figure of `report` has: at least one (an empty report says so in it)."""
    return max(1, len(report.get("choices") or []) + len(_fp8_modules(report)))


def pixel_size(report: dict[str, Any]) -> tuple[int, int]:
    """(width, height) in pixels of the PNG `save_plot` writes for `report`."""
    return WIDTH_PX, PANEL_PX * panels(report)


def _timings_panel(ax: Any, choice: dict[str, Any]) -> None:
    timings = {str(p): v for p, ms in (choice.get("timings_ms") or {}).items() if (v := _number(ms)) is not None}
    rule = choice.get("rule")
    ax.set_title(f"{choice['module']}: runs {choice['path']}" + (f" ({rule})" if rule else ""), loc="left")
    if not timings:
        why = "verdict from cache" if choice.get("cached") else "no candidates were timed"
        ax.text(0.5, 0.5, f"no step times: {why}", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    paths = list(timings)
    bars = ax.barh(paths, [timings[p] for p in paths], color=[CHOSEN if p == choice["path"] else OTHER for p in paths])
    ax.bar_label(bars, fmt="%.3g", padding=3)
    ax.invert_yaxis()  # the report's order, top down
    ax.set_xlabel("median step time (ms)")
    ax.margins(x=0.15)


def _fp8_panel(ax: Any, module: str, fp8: dict[str, Any]) -> None:
    from matplotlib.lines import Line2D

    min_gain, max_error, from_report = fp8_thresholds(fp8)
    points = [(g, err, c.get("dtype")) for c in fp8["layers"].values() if isinstance(c, dict)
              and (g := _number(c.get("predicted_gain"))) is not None
              and (err := _number(c.get("measured_error"))) is not None]
    colours = [FP8_COLOUR if d == "fp8" else BF16_COLOUR for _, _, d in points]
    ax.scatter([g for g, _, _ in points], [e for _, e, _ in points], c=colours, s=24)
    ax.axvline(min_gain, color="black", linestyle="--", linewidth=1)
    ax.axhline(max_error, color="tab:red", linestyle="--", linewidth=1)
    unplotted = len(fp8["layers"]) - len(points)
    source = "" if from_report else "\nthresholds: automp's defaults (the report does not carry them)"
    ax.set_title(f"{module}: FP8 per linear layer ({fp8.get('recipe')}), {len(points)} plotted"
                 + (f", {unplotted} without a gain or an error" if unplotted else "") + source, loc="left")
    ax.set_xlabel("predicted gain over bf16 (x)")
    ax.set_ylabel("measured error vs bf16")
    ax.legend(handles=[Line2D([], [], marker="o", linestyle="", color=FP8_COLOUR, label="fp8"),
                       Line2D([], [], marker="o", linestyle="", color=BF16_COLOUR, label="bf16"),
                       Line2D([], [], color="black", linestyle="--", label=f"min gain {min_gain:g}"),
                       Line2D([], [], color="tab:red", linestyle="--", label=f"max error {max_error:g}")],
              loc="best", fontsize="small")


def figure(report: dict[str, Any]) -> Any:
    """The matplotlib Figure of `report` (already checked: automp.runtime.report.load_saved_report): a panel of
    horizontal bars per root module, its candidate paths' step times with the chosen one highlighted, then a panel
    per module with FP8 layers, predicted gain against measured error coloured by the dtype chosen, the thresholds
    drawn as lines. Returned for a test to read the plotted values back."""
    from matplotlib.figure import Figure

    width, height = pixel_size(report)
    fig = Figure(figsize=(width / DPI, height / DPI), dpi=DPI, layout="constrained")
    axes = fig.subplots(panels(report), 1, squeeze=False)[:, 0]
    choices, fp8 = list(report.get("choices") or []), _fp8_modules(report)
    for ax, choice in zip(axes, choices):
        _timings_panel(ax, choice)
    for ax, (module, entry) in zip(axes[len(choices):], fp8):
        _fp8_panel(ax, module, entry)
    if not choices and not fp8:
        axes[0].text(0.5, 0.5, "the report holds no path choice and no FP8 layer", ha="center", va="center")
        axes[0].set_axis_off()
    fig.suptitle(f"automp report: {report.get('dtype')} on {report.get('device')}")
    return fig


def save_plot(report: dict[str, Any], out: str | os.PathLike) -> None:
    """Write `report`'s figure to `out` as a PNG of pixel_size(report), atomically: a failed write leaves what was
    there before (automp.files.atomic_output)."""
    from automp.files import atomic_output
    fig = figure(report)
    with atomic_output(out) as tmp:
        fig.savefig(tmp, format="png", dpi=DPI)
