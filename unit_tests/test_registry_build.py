"""``Registry.build``: one way every registered family binds options (estimators and controllers alike)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from asyncrl.configurable import ConfigError, check, field
from asyncrl.controllers import build as build_controller
from asyncrl.estimators import build as build_estimator
from asyncrl.registry import Registry


@dataclass(frozen=True)
class _Cfg:
    n: int = field(1, help="a count")

    def __post_init__(self) -> None:
        check(self.n >= 0, "n", self.n, "use n >= 0")


class _Thing:
    Config = _Cfg

    def __init__(self, n: int = 1) -> None:
        self.n = n


def test_build_validates_through_config_and_calls_with_keywords() -> None:
    reg: Registry = Registry("thing")
    reg.add("thing", _Thing)
    reg.add("singleton", object())
    assert reg.build("thing", {"n": "3"}).n == 3  # coerced by the Config
    with pytest.raises(ConfigError, match=r"'options\.n'"):
        reg.build("thing", {"n": -1})
    with pytest.raises(ConfigError, match="did you mean 'n'"):
        reg.build("thing", {"m": 1})
    with pytest.raises(ConfigError, match=r"'name'.*did you mean 'thing'"):
        reg.build("thin", {})
    with pytest.raises(ConfigError, match="takes no options"):
        reg.build("singleton", {"n": 1})


def test_estimators_and_controllers_report_errors_the_same_way() -> None:
    for build, name in ((build_estimator, "forward_kl"), (build_controller, "truncated_is")):
        with pytest.raises(ConfigError) as err:
            build(name, {"no_such_option": 1})
        assert err.value.field == "options.no_such_option"
        with pytest.raises(ConfigError) as err:
            build(name + "x", {})
        assert err.value.field == "name"
