"""`automp report FILE`: a file that is not a precision report is a one-line error, never a traceback."""
import json

import pytest

from automp.cli import main
from automp.runtime.report import print_saved_report, summarize


def _node(**over):
    return {"name": "mm", "op": "aten.mm", "dtype": "bfloat16", "reason": "allow list", **over}


def _report(**over):
    graph = {"name": "g0.forward", "kind": "forward", "nodes": [_node(), _node(name="sm", op="aten.softmax",
                                                                          dtype="float32", reason="deny list")],
             "casts": {"inserted": 2, "eliminated": 1, "remaining": 1}}
    return {"device": "cpu", "dtype": "bfloat16", "graphs": [graph], "loss_scale": {"scale": 1.0, "steps": 3,
                                                                                    "overflow_steps": 0},
            "fallbacks": [], **over}


def _saved(tmp_path, content) -> str:
    path = tmp_path / "rep.json"
    path.write_text(json.dumps(content))
    return str(path)


def test_a_valid_report_prints(tmp_path, capsys):
    choices = [{"module": "GPT", "path": "compiled", "reason": "fastest", "cached": False}]
    print_saved_report(_saved(tmp_path, _report(choices=choices, compiles={"GPT": 2})), show_nodes=True)
    out = capsys.readouterr().out
    assert "g0.forward" in out and "aten.softmax" in out and "GPT" in out


@pytest.mark.parametrize("content,where", [
    ([1, 2, 3], "list"),
    ("just a string", "str"),
    ({"device": "cpu", "dtype": "bf16"}, "'graphs'"),
    (_report(graphs={"g": 1}), "graphs"),
    (_report(graphs=[{"name": "g", "kind": "forward", "casts": {}}]), "graphs[0]"),
    (_report(graphs=[{**_report()["graphs"][0], "name": 7}]), "graphs[0]"),
    (_report(graphs=[{"name": "g", "kind": "forward", "nodes": [], "casts": {"inserted": 1}}]), "graphs[0].casts"),
    (_report(graphs=[{**_report()["graphs"][0], "nodes": [_node(), {"name": "x"}]}]), "graphs[0].nodes[1]"),
    (_report(graphs=[{**_report()["graphs"][0], "nodes": [_node(reason=None)]}]), "graphs[0].nodes[0]"),
    (_report(graphs=[{**_report()["graphs"][0], "nodes": ["aten.mm"]}]), "graphs[0].nodes[0]"),
    (_report(fallbacks=[{"where": "f"}]), "fallbacks[0]"),
    (_report(loss_scale=[1.0]), "loss_scale"),
    (_report(compiles=[3]), "compiles"),
    (_report(choices=[{"module": "GPT", "path": "compiled"}]), "choices[0]"),
    (_report(choices="GPT"), "choices"),
    ({k: v for k, v in _report().items() if k != "dtype"}, "'dtype'"),
])
def test_wrong_shapes_are_one_line_errors(tmp_path, capsys, content, where):
    path = _saved(tmp_path, content)
    with pytest.raises(SystemExit) as exc:
        main(["report", path])
    msg = str(exc.value.code)
    assert msg.startswith(f"automp report: {path} is not an automp precision report") and where in msg
    assert "\n" not in msg


def test_unreadable_files_are_one_line_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for path in (bad, tmp_path / "missing.json"):
        with pytest.raises(SystemExit, match=f"automp report: cannot read {path}"):
            print_saved_report(str(path))


def test_summarize_names_the_malformed_part():
    with pytest.raises(ValueError, match=r"graphs\[0\]\.nodes\[0\]"):
        summarize(_report(graphs=[{**_report()["graphs"][0], "nodes": [{"op": "aten.mm"}]}]))
    assert summarize(_report())[0]["by_dtype"] == {"bfloat16": 1, "float32": 1}


def test_a_report_without_graphs_says_so_instead_of_an_empty_table(capsys):
    """Every module ran eagerly (a CPU, or FP32 measured fastest): an empty node table would read as a failure."""
    from automp.runtime.report import print_report
    choices = [{"module": "GPT", "path": "fp32-eager", "reason": "fp32-eager 28.9 ms, low-precision-eager 30.4 ms"}]
    print_report(_report(graphs=[], choices=choices))
    out = capsys.readouterr().out
    assert "no graph went through" in out and "casts +/-/=" not in out and "fp32-eager 28.9 ms" in out
    print_report(_report())
    out = capsys.readouterr().out
    assert "no graph went through" not in out and "casts +/-/=" in out and "g0.forward" in out
