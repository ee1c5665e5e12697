"""AutoMPConfig parses every source once (keywords, the environment, the command line) into canonical fields;
enable() and compile() take it with keyword overrides, and a bad one leaves automp as it was."""
import argparse
import os
import warnings

import pytest
import torch
import torch.nn as nn
from torch.optim import optimizer as optimizers

import automp
from automp.config import AutoMPConfig
from automp.runtime.session import ORIG_CALL
from automp.scaling import autograd_hook


@pytest.mark.parametrize("alias, canonical, dtype", [("half", "fp16", torch.float16), ("float16", "fp16", torch.float16),
                                                      ("bfloat16", "bf16", torch.bfloat16), ("bf16", "bf16",
                                                                                             torch.bfloat16)])
def test_dtype_aliases_are_stored_canonical(alias, canonical, dtype):
    config = AutoMPConfig(dtype=alias)
    assert config.dtype == canonical and config.low_dtype("cpu") is dtype
    assert AutoMPConfig().low_dtype("cpu") is torch.bfloat16  # auto: bf16 wherever the device has it


@pytest.mark.parametrize("given, parsed", [("dynamic", "dynamic"), ("off", None), (None, None), (0, None),
                                           ("1024", 1024.0), (512, 512.0), (" 2e3 ", 2000.0)])
def test_loss_scale_is_parsed_once(given, parsed):
    assert AutoMPConfig(loss_scale=given).loss_scale == parsed


@pytest.mark.parametrize("given", ["banana", -1, float("inf"), True, [1]])
def test_a_bad_loss_scale_names_itself(given):
    with pytest.raises(ValueError, match="loss_scale"):
        AutoMPConfig(loss_scale=given)


def test_fields_are_keywords_only():
    with pytest.raises(TypeError):
        AutoMPConfig("bf16")  # noqa


def test_the_cache_directory_is_always_resolved(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOMP_CACHE_DIR", str(tmp_path / "env"))
    assert AutoMPConfig(cache_dir=str(tmp_path / "given")).cache_dir == str(tmp_path / "given")
    assert AutoMPConfig().cache_dir == str(tmp_path / "env")
    monkeypatch.delenv("AUTOMP_CACHE_DIR")
    assert AutoMPConfig().cache_dir == os.path.expanduser(os.path.join("~", ".cache", "automp"))


def test_the_environment_is_read_and_overrides_win(tmp_path):
    env = {"AUTOMP_INNER": "eager", "AUTOMP_PATH": "fp32", "AUTOMP_CACHE_DIR": str(tmp_path), "AUTOMP_DEBUG": "1",
           "RANK": "3", "WORLD_SIZE": "4"}
    config = AutoMPConfig.from_env(env)
    assert (config.inner, config.path, config.cache_dir, config.debug, config.rank, config.world_size) == (
        "eager", "fp32", str(tmp_path), True, 3, 4)
    assert AutoMPConfig.from_env(env, path="compile", inner="inductor").path == "compile"
    assert not AutoMPConfig.from_env({"AUTOMP_DEBUG": "0"}).debug
    with pytest.raises(ValueError, match="AUTOMP_PATH"):
        AutoMPConfig.from_env({"AUTOMP_PATH": "warp"})
    with pytest.raises(ValueError, match="RANK"):
        AutoMPConfig.from_env({"RANK": "zero"})


def test_the_command_line_wins_over_the_environment_where_given():
    env = {"AUTOMP_PATH": "eager"}
    args = argparse.Namespace(dtype="fp16", loss_scale="1024", report=None, path=None, fuse_optimizers=False,
                              tune_cudnn=True, tune_layout=True, cuda_graphs=True, script="s.py", args=[])
    config = AutoMPConfig.from_cli(args, env)
    assert (config.dtype, config.loss_scale, config.path, config.fuse_optimizers) == ("fp16", 1024.0, "eager", False)
    args.path = "auto"
    assert AutoMPConfig.from_cli(args, env).path == "auto"


def test_fp8_output_is_off_unless_asked_for():
    assert AutoMPConfig().fp8_output is False and AutoMPConfig(fp8_output=True).fp8_output is True
    args = argparse.Namespace(dtype="fp8", fp8_output=True, script="s.py", args=[])
    assert AutoMPConfig.from_cli(args, {}).fp8_output is True
    with pytest.raises(TypeError, match="fp8_output must be"):
        AutoMPConfig(fp8_output="yes")


def test_fp8_all_gather_is_on_unless_turned_off():
    from automp.cli import build_parser
    assert AutoMPConfig().fp8_all_gather is True
    args = build_parser().parse_args(["run", "--dtype", "fp8", "--no-fp8-all-gather", "train.py"])
    assert AutoMPConfig.from_cli(args, {}).fp8_all_gather is False
    args = build_parser().parse_args(["run", "--dtype", "fp8", "train.py"])
    assert AutoMPConfig.from_cli(args, {}).fp8_all_gather is True
    with pytest.raises(TypeError, match="fp8_all_gather must be"):
        AutoMPConfig(fp8_all_gather=0)


def test_fp8_keep_is_parsed_once_from_every_source():
    assert AutoMPConfig(fp8_keep="lm_head, *.self_attn.*").fp8_keep == ("lm_head", "*.self_attn.*")
    assert AutoMPConfig(fp8_keep=["lm_head"]).fp8_keep == ("lm_head",) and AutoMPConfig(fp8_keep="").fp8_keep == ()
    assert AutoMPConfig.from_env({"AUTOMP_FP8_KEEP": "lm_head"}).fp8_keep == ("lm_head",)
    args = argparse.Namespace(dtype="fp8", fp8_keep="head", script="s.py", args=[])
    assert AutoMPConfig.from_cli(args, {"AUTOMP_FP8_KEEP": "lm_head"}).fp8_keep == ("head",)
    with pytest.raises(ValueError, match="AUTOMP_FP8_KEEP=.*empty pattern"):
        AutoMPConfig.from_env({"AUTOMP_FP8_KEEP": "lm_head,,q"})
    with pytest.raises(TypeError, match="fp8_keep must be"):
        AutoMPConfig(fp8_keep=[3])


def test_each_rank_has_its_own_report_path(tmp_path):
    report = str(tmp_path / "r.json")
    assert AutoMPConfig(report=report).report_path == report
    assert AutoMPConfig(report=report, rank=2, world_size=4).report_path == str(tmp_path / "r.rank2.json")


def test_enable_takes_a_config_and_overrides(fresh_session):
    automp.enable(AutoMPConfig(dtype="fp16", inner="eager"), dtype="bf16", path="eager")
    config = automp._session.config
    assert (config.dtype, config.inner, config.path) == ("bf16", "eager", "eager")


@pytest.mark.parametrize("bad", [{"bogus": 1}, {"dtype": "int3"}, {"loss_scale": "banana"}])
def test_a_bad_override_leaves_automp_as_it_was(bad, fresh_session):
    automp.enable(dtype="bf16", inner="eager")
    before = automp._session
    with pytest.raises((TypeError, ValueError)):
        automp.enable(**bad)
    assert automp._session is before and nn.Module.__call__ is not ORIG_CALL


def test_disable_undoes_everything_enable_installed(fresh_session):
    hooks = dict(optimizers._global_optimizer_pre_hooks)
    automp.enable(dtype="fp16", inner="eager", path="eager")
    assert autograd_hook.current() is not None and "__call__" in vars(nn.RNNBase)
    automp.disable()
    assert nn.Module.__call__ is ORIG_CALL and "__call__" not in vars(nn.RNNBase)
    assert autograd_hook.current() is None and dict(optimizers._global_optimizer_pre_hooks) == hooks


def test_compile_goes_through_the_session_and_disable_removes_its_scaler(tmp_path, fresh_session):
    report = tmp_path / "compiled.json"
    net = automp.compile(nn.Linear(8, 4), dtype="fp16", inner="eager", spec="h100", report=str(report))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net(torch.randn(2, 8)).float().sum().backward()
    assert autograd_hook.current() is not None
    rep = automp.disable()
    assert autograd_hook.current() is None and not automp.is_enabled()
    assert rep["graphs"] and report.exists()
    assert nn.Module.__call__ is ORIG_CALL  # compile alone patches no module call


@pytest.mark.parametrize("name, value, accepts", [
    ("path", None, r"path must be one of \['auto', 'compile'"), ("path", 3, "path must be one of"),
    ("inner", None, r"inner must be one of \['inductor', 'eager'\]"),
    ("fp8_recipe", None, r"fp8_recipe must be one of \['tensorwise', 'rowwise', 'auto'\]"),
    ("dtype", None, r"dtype must be one of \['auto', 'fp16', 'bf16', 'fp8'\]"),
    ("spec", 5, r"spec must be None or one of \["), ("cache_dir", 3, "cache_dir must be None or a directory path"),
    ("report", 3, "report must be None or a file path"), ("debug", None, "debug must be True or False"),
    ("rank", None, "rank must be an integer >= 0")])
def test_a_none_or_wrongly_typed_field_is_one_clear_error_naming_it(name, value, accepts, fresh_session):
    with pytest.raises(ValueError, match=f"{accepts}.*got {value!r}$"):
        AutoMPConfig(**{name: value})
    with pytest.raises(ValueError, match=accepts):  # the same through enable(), before anything is installed
        automp.enable(**{name: value})
    assert not automp.is_enabled() and nn.Module.__call__ is ORIG_CALL


def test_fused_linear_ce_is_off_unless_asked_for_on_the_command_line_or_in_the_environment():
    from automp.cli import build_parser
    parse = build_parser().parse_args
    assert AutoMPConfig().fuse_linear_ce is False
    assert AutoMPConfig.from_cli(parse(["run", "s.py"]), {}).fuse_linear_ce is False
    assert AutoMPConfig.from_cli(parse(["run", "--fuse-linear-ce", "s.py"]), {}).fuse_linear_ce is True
    assert AutoMPConfig.from_cli(parse(["run", "s.py"]), {"AUTOMP_FUSE_LINEAR_CE": "1"}).fuse_linear_ce is True
    assert AutoMPConfig.from_env({"AUTOMP_FUSE_LINEAR_CE": "0"}).fuse_linear_ce is False


def test_fused_siblings_are_off_unless_asked_for():
    from automp.cli import build_parser
    parse = build_parser().parse_args
    assert AutoMPConfig().fuse_siblings is False
    assert AutoMPConfig.from_cli(parse(["run", "--fuse-siblings", "s.py"]), {}).fuse_siblings is True
    assert AutoMPConfig.from_cli(parse(["run", "s.py"]), {"AUTOMP_FUSE_SIBLINGS": "1"}).fuse_siblings is True
    with pytest.raises(TypeError, match="fuse_siblings must be"):
        AutoMPConfig(fuse_siblings="yes")


def test_causal_attention_is_on_unless_switched_off_on_the_command_line():
    from automp.cli import build_parser
    parse = build_parser().parse_args
    assert AutoMPConfig().causal_attention is True
    assert AutoMPConfig.from_cli(parse(["run", "s.py"]), {}).causal_attention is True
    assert AutoMPConfig.from_cli(parse(["run", "--no-causal-attention", "s.py"]), {}).causal_attention is False
    with pytest.raises(ValueError, match="causal_attention must be True or False"):
        AutoMPConfig(causal_attention="yes")


def test_quiet_is_off_unless_asked_for_on_the_command_line():
    from automp.cli import build_parser
    assert AutoMPConfig().quiet is False
    assert AutoMPConfig.from_cli(build_parser().parse_args(["run", "--quiet", "s.py"]), {}).quiet is True
    assert AutoMPConfig.from_cli(build_parser().parse_args(["run", "s.py"]), {}).quiet is False
    with pytest.raises(TypeError, match="quiet must be"):
        AutoMPConfig(quiet="yes")
