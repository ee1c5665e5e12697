"""`automp report FILE`: a file that is not a precision report is a one-line error, never a traceback."""
import json

import pytest

from automp.cli import main
from automp.runtime.report import NotAReport, print_saved_report, summarize


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
    (_report(choices=[{"module": "GPT", "path": "fp32-eager", "reason": "r", "calls": {"trial": 3}}]),
     "choices[0].calls"),
    ({k: v for k, v in _report().items() if k != "dtype"}, "'dtype'"),
])
def test_wrong_shapes_are_one_line_errors(tmp_path, capsys, content, where):
    path = _saved(tmp_path, content)
    assert main(["report", path]) == 2  # the file named on the command line is wrong: a usage error
    captured = capsys.readouterr()
    msg = captured.err
    assert msg.startswith(f"automp report: {path} is not an automp precision report") and where in msg
    assert msg.count("\n") == 1 and captured.out == ""


def test_unreadable_files_are_one_line_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(NotAReport, match=f"{bad} is not JSON \\(invalid at line 1, column 2\\)"):
        print_saved_report(str(bad))
    missing = tmp_path / "missing.json"
    with pytest.raises(NotAReport, match=f"cannot read {missing}: No such file"):
        print_saved_report(str(missing))


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


def test_the_calls_each_precision_ran_are_printed_with_the_choice(capsys):
    """A run that kept FP32 after its trial ran some calls in low precision: the report says how many."""
    from automp.runtime.report import print_report
    choices = [{"module": "CNN", "path": "fp32-eager", "reason": "r",
                "calls": {"trial": {"low-precision-eager": 12, "fp32-eager": 6}, "chosen": {"fp32-eager": 30}}}]
    print_report(_report(graphs=[], choices=choices))
    out = " ".join(capsys.readouterr().out.split())
    assert "CNN runs fp32-eager (trial: 12 calls bfloat16, 6 FP32; chosen: 30 calls FP32)" in out


def test_each_paths_compile_time_and_cache_hits_are_printed(capsys):
    from automp.runtime.report import print_report
    times = {"GPT": {"autocast-compiled": {"graphs": 1, "backend_s": 20.0, "backward_s": 11.5, "aot_cache_hits": 0,
                                           "fx_cache_hits": 0},
                     "autocast-graphed": {"graphs": 1, "backend_s": 0.75, "backward_s": 0, "aot_cache_hits": 1,
                                          "fx_cache_hits": 2}}}
    print_report(_report(graphs=[], compile_times=times))
    out = " ".join(capsys.readouterr().out.split())
    assert ("GPT compiling: autocast-compiled 31.5 s over 1 graph(s); autocast-graphed 0.8 s over 1 graph(s) "
            "(1 AOTAutograd cache hit(s), 2 FX graph cache hit(s))") in out


def _binary(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * 4)
    return path


def _deep(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    return path


@pytest.mark.parametrize("make, says", [
    (lambda tmp: tmp, "is a directory, not a report file"),
    (_binary, "is not JSON (it is not UTF-8 text"),
    (lambda tmp: (tmp / "a.json").write_text("{oops") and tmp / "a.json", "is not JSON (invalid at line 1, column 2)"),
    (lambda tmp: (tmp / "e.json").write_text("\n") and tmp / "e.json", "is empty"),
    (_deep, "nested too deeply"),
    (lambda tmp: tmp / "none.json", "cannot read"),
])
def test_files_that_are_no_report_are_one_plain_line_rc_2(tmp_path, capsys, make, says):
    """A directory, a binary file, text that is not JSON: one line naming the file and the problem in words, no
    parser position jargon, no traceback, exit status 2."""
    path = make(tmp_path)
    assert main(["report", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("automp report: ") and str(path) in captured.err and says in captured.err
    assert captured.err.count("\n") == 1 and "char" not in captured.err and captured.out == ""


@pytest.mark.parametrize("section, where", [
    ({"optimizers": [{"optimizer": "Adam"}]}, "optimizers[0]"),
    ({"optimizers": "Adam"}, "optimizers"),
    ({"settings": [{"setting": "cudnn.benchmark", "value": True}]}, "settings[0]"),
    ({"unread_outputs": ["logits"]}, "unread_outputs"),
    ({"unread_outputs": {"GPT": "logits"}}, "unread_outputs['GPT']"),
    ({"unread_outputs": {"GPT": {"detached": 3}}}, "unread_outputs['GPT'].detached"),
])
def test_a_malformed_optional_section_rejects_the_file_in_one_line(tmp_path, capsys, section, where):
    """The sections printed after the table are checked like the rest: printing the others would pass a damaged
    file for a whole report."""
    path = _saved(tmp_path, _report(**section))
    assert main(["report", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"automp report: {path} is not an automp precision report: {where}") and err.count("\n") == 1


def test_text_in_a_report_is_printed_as_text_not_markup(tmp_path, capsys):
    """A reason such as "[/x]" would be rich markup (a closing tag with no opening one raises)."""
    fallbacks = [{"where": "[/where]", "reason": "[/x] [bold]"}]
    settings = [{"setting": "[/s]", "value": "[/v]", "reason": "[/r]"}]
    graph = {**_report()["graphs"][0], "nodes": [_node(reason="[/n]")]}
    assert main(["report", _saved(tmp_path, _report(fallbacks=fallbacks, settings=settings, graphs=[graph])),
                 "--nodes"]) == 0
    out = capsys.readouterr().out
    assert "[/x] [bold]" in out and "[/v]" in out and "[/n]" in out


def test_the_fp8_choice_is_printed_with_its_rules_and_all_gather(capsys, monkeypatch):
    """Under dtype="fp8" the report says how many layers each rule decided, the FSDP2 all-gather's rules and why a
    layer kept its gather, every layer's choice with --nodes, and when the run left FP8."""
    from automp.runtime.report import print_report
    monkeypatch.setenv("COLUMNS", "200")  # one line per message, whatever terminal runs the test
    layers = {"mlp.up": {"dtype": "fp8", "predicted_gain": 1.42, "measured_error": 0.037, "rule": "fp8-predicted-gain",
                         "shape": [8192, 2048, 8192]},
              "lm_head": {"dtype": "bf16", "predicted_gain": None, "measured_error": None,
                          "rule": "bf16-output-layer", "shape": None}}
    fp8 = {"Llama": {"recipe": "tensorwise", "fp8_layers": 1, "layers_seen": 2,
                     "rules": {"fp8-predicted-gain": 1, "bf16-output-layer": 1}, "layers": layers,
                     "all_gather": {"rules": {"fp8-all-gather": 1}, "why": {}}}}
    left = {"step": 40, "loss": "nan", "median": 3.1, "rule": "non-finite-loss"}
    print_report(_report(fp8=fp8, fp8_fallback=left), show_nodes=True)
    out = capsys.readouterr().out
    assert "Llama FP8 (tensorwise): 1 of 2 linear layers (fp8-predicted-gain 1, bf16-output-layer 1)" in out
    assert "FSDP2 all-gather of the FP8 layers: fp8-all-gather 1" in out
    assert "mlp.up" in out and "1.42x" in out and "0.037" in out and "8192 x 2048 x 8192" in out
    assert "left FP8 for bf16 at backward 40: non-finite-loss (loss nan, recent median 3.1)" in out
    print_report(_report(fp8=fp8))
    assert "mlp.up" not in capsys.readouterr().out  # the per-layer table only with --nodes
