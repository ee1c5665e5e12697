import pytest

from automp.scaling.loss_scale import LossScaleConfig, LossScaler


def test_dynamic_backs_off_on_overflow_and_grows_after_clean_interval():
    s = LossScaler(LossScaleConfig(init_scale=1024.0, growth_interval=3))
    s.update(found_inf=True)
    assert s.scale == 512.0
    s.update(False), s.update(False)
    assert s.scale == 512.0  # two clean steps are not yet an interval
    s.update(False)
    assert s.scale == 1024.0
    s.update(False), s.update(True)  # an overflow resets the clean-step count
    s.update(False), s.update(False)
    assert s.scale == 512.0
    assert s.summary() == {"scale": 512.0, "overflow_steps": 2, "steps": 8}


def test_default_config_is_the_issue_spec():
    c = LossScaleConfig()
    assert (c.init_scale, c.growth_interval, c.growth_factor, c.backoff_factor) == (2.0 ** 16, 2000, 2.0, 0.5)


def test_floor_and_ceiling_hold():
    s = LossScaler(LossScaleConfig(init_scale=4.0, min_scale=1.0, max_scale=8.0, growth_interval=1))
    for _ in range(5):
        s.update(True)
    assert s.scale == 1.0
    for _ in range(5):
        s.update(False)
    assert s.scale == 8.0


def test_constant_and_off_never_move():
    c = LossScaler.from_spec(128.0)
    for found in (True, False, True):
        c.update(found)
    assert c.config.mode == "constant" and c.scale == 128.0 and c.summary()["overflow_steps"] == 2
    off = LossScaler.from_spec("off")
    assert not off.enabled and off.scale == 1.0


@pytest.mark.parametrize("spec,mode,scale", [("dynamic", "dynamic", 65536.0), ("1024", "constant", 1024.0),
                                             (None, "off", 1.0), (0, "off", 1.0), (2.0, "constant", 2.0)])
def test_from_spec(spec, mode, scale):
    s = LossScaler.from_spec(spec)
    assert (s.config.mode, s.scale) == (mode, scale)


@pytest.mark.parametrize("bad", ["huge", -1.0, float("inf"), float("nan")])
def test_bad_spec_names_the_problem(bad):
    with pytest.raises(ValueError, match="loss_scale|init_scale"):
        LossScaler.from_spec(bad)


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="mode"):
        LossScaleConfig(mode="adaptive")
    with pytest.raises(ValueError, match="growth_interval"):
        LossScaleConfig(growth_interval=0)


def test_state_dict_round_trip_resumes_the_same_machine():
    a = LossScaler(LossScaleConfig(init_scale=256.0, growth_interval=4))
    for found in (False, True, False, False):
        a.update(found)
    b = LossScaler()
    b.load_state_dict(a.state_dict())
    for found in (False, False, True, False, False, False, False):
        a.update(found), b.update(found)
        assert a.summary() == b.summary() and a.growth_tracker == b.growth_tracker
    with pytest.raises(ValueError, match="lacks"):
        b.load_state_dict({"scale": 1.0})
